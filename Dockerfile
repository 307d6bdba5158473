# One image for every Switchyard service (compose.yaml picks the role by command).
# GPU engines arrive as extras (`.[vllm]`) with the vLLM engine; the sim engine needs none.
FROM python:3.11-slim
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
RUN pip install --no-cache-dir .
ENTRYPOINT []
CMD ["switchyard", "up", "--host", "0.0.0.0"]
