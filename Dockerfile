# One image for every Switchyard service on a GPU host (compose.yaml picks the role by command):
# vLLM's CUDA build, LMCache and Mooncake (whose master and segment commands compose runs too),
# and the OTLP span exporter (compose sends every service's traces to its collector).
FROM python:3.11-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 libnl-3-200 libnl-route-3-200 \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY scheduler scheduler
COPY workers workers
COPY kvbus kvbus
COPY ingress ingress
COPY observability observability
COPY switchyard switchyard
COPY bench bench
RUN pip install --no-cache-dir '.[vllm,kv,otlp]'
ENTRYPOINT []
CMD ["switchyard", "up", "--host", "0.0.0.0"]
