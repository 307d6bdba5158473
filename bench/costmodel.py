"""The cost model of a simulated worker, calibrated to a published H100 measurement.

One simulated worker is one model instance: **Llama-3.3-70B-Instruct, FP8, tensor
parallel over 2 x H100 80GB SXM**, the configuration whose latencies NVIDIA publishes:

    NVIDIA NIM for LLMs, "Benchmarking: Performance", Llama-3.3-70b-instruct, NIM 1.8.0,
    2 x H100 80G, fp8, TP2 (https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance)

    input / output   concurrency   TTFT (ms)   ITL (ms)   throughput (tokens/s)
    5000 / 500            1          406.77      18.58          51.67
    5000 / 500            5          546.70      21.83         218.48
    5000 / 500           25          688.69      38.75         623.40
    5000 / 500           50          834.51      59.73         814.37
    5000 / 500          100         7996.25      92.91         917.26   (saturated)
     500 / 2000           1           47.77      18.91          52.85

Model facts (Llama-3.3-70B ``config.json``): 80 layers, hidden size 8192, 8 KV heads
of 128, 70.6 B parameters. KV cache in FP8: 2 x 80 x 8 x 128 x 1 B = 163,840 B/token.

**Prefill** (compute-bound): an iteration computing prompt tokens ``c..n`` of its
requests costs ``a + b * (n - c + (n^2 - c^2) / L)``. The second term is causal
attention: a token at position ``i`` costs ``4 * layers * hidden * i`` FLOPs beside the
``2 * params`` of the dense layers, so ``L = params / (layers * hidden) = 107,727``
(attention at the dense layers' efficiency, an assumption). Fitted exactly to the two
concurrency-1 TTFTs (500 and 5000 tokens): ``b = 75.90 us/token`` (13.2k tokens/s, a
5000-token prompt pays 4.6 % for attention, a 30,000-token one 28 %) and
``a = 9.64 ms``.

**Decode** (memory-bound): a step emits one token per running sequence and costs
``base + per_seq * batch + per_kv * KV tokens held``. ``base = 18.6 ms`` is the
concurrency-1 ITL (both rows agree within 2 %; reading the 70.6 GB of weights is most
of it). ``per_kv = 24.5 ns`` is reading one token's FP8 KV at the two GPUs' HBM peak
(163,840 B / 6.7 TB/s); the ITL rows cannot separate it from ``per_seq``, as their
KV per sequence is fixed. ``per_seq = 0.07 ms`` is then fitted to the ITL at
concurrency 5, 25 and 50 by replaying that closed loop through this model on one
colocated worker (``docs/bench-sim.md``): model 21.9 / 38.6 / 60.0 ms against 21.83 /
38.75 / 59.73 measured. The model's TTFT under load is 14-35 % above the table's
(622 / 930 / 999 ms against 547 / 689 / 835): it is pessimistic for colocated prefill.

**Colocated** iterations mix both: vLLM's chunked prefill packs the decode tokens of
every running sequence and then prompt chunks up to ``max_num_batched_tokens`` (8192,
vLLM's default for the API server on H100-class GPUs, ``vllm/engine/arg_utils.py``) into
one iteration, which costs the decode step plus ``b`` per prompt token: decode slows
while prefills run, the interference disaggregation removes.

**KV capacity**: 2 x 80 GB less 70.6 GB of weights and ~10 % for activations leaves
~75 GB, 450,000 tokens (878 blocks of 512), consistent with the table saturating near
concurrency 80-90 of 5,500-token sequences. It bounds a decode worker's KV tokens
(its ``token_budget``) and, as a prefix cache, a prefill worker's cached blocks.

**Handoff**: the prompt's KV moves prefill -> decode at ``link_bytes_per_s``; we assume
one 400 Gb/s RDMA NIC (ConnectX-7, 50 GB/s) per instance, whole prompt after prefill
(no layer-wise overlap): 12,000 tokens take 39 ms.

**Host and disk tiers** (``--host-cache-blocks``, ``--disk-cache-blocks``): a prefix
block found in host DRAM or on local disk must be loaded to the GPUs before the prompt's
first chunk (512 tokens of FP8 KV: 83.9 MB a block). Assumed, per instance (2 GPUs):

- host -> GPU at ``host_bytes_per_s`` = 100 GB/s: each H100 SXM has its own PCIe Gen5
  x16 link (32 GT/s x 16 lanes, ~63 GB/s a direction, the PCIe 5.0 spec; NVIDIA's H100
  datasheet gives 128 GB/s both ways), of which pinned host-to-device copies reach ~80 %,
  ~50 GB/s; with TP2 each GPU loads its own half of the KV heads over its own link. A
  block takes 0.84 ms, a 12,000-token prefix 20 ms (its prefill: ~1 s).
- disk -> GPU at ``disk_bytes_per_s`` = 12 GB/s: a DGX H100 has eight 3.84 TB U.2 NVMe
  data drives (its datasheet), so a 2-GPU instance's share is two; a datacenter PCIe
  Gen4 U.2 drive reads ~7 GB/s sequentially (e.g. Samsung PM1733's spec sheet), taken as
  6 GB/s each for 84 MB reads through a file system. The read lands in host memory and
  crosses PCIe after, pipelined, so the slower disk sets the rate: 7 ms a block.

A worker loads one prompt's blocks at a time, host blocks and disk blocks back to back
(``fetch_s``), and the prompt waits for its load while the worker's other prompts and
decodes go on: vLLM's asynchronous KV connectors (LMCache, NIXL) park such a request in
``WAITING_FOR_REMOTE_KVS`` and schedule the others; a synchronous load that stalls the
whole iteration would cost the other requests more. The load does not contend with the
prefill -> decode handoff (a NIC, not the host link) nor slow the GPU's compute.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_BYTES_PER_TOKEN = 2 * 80 * 8 * 128 * 1  # Llama-3.3-70B, FP8 KV cache
ATTENTION_TOKENS = 70.6e9 / (80 * 8192)  # L: prompt length at which attention costs as much as the rest


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds, per model instance (2 x H100, Llama-3.3-70B FP8); see the module notes."""

    prefill_base_s: float = 9.64e-3
    per_token_s: float = 75.90e-6
    attention_tokens: float = ATTENTION_TOKENS
    decode_base_s: float = 18.6e-3
    decode_per_seq_s: float = 0.07e-3
    decode_per_kv_token_s: float = KV_BYTES_PER_TOKEN / 6.7e12  # 24.5 ns: HBM peak of 2 x H100
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN
    link_bytes_per_s: float = 50e9
    host_bytes_per_s: float = 100e9  # host DRAM -> the instance's GPUs (2 x PCIe Gen5 x16)
    disk_bytes_per_s: float = 12e9  # local NVMe -> the instance's GPUs (2 x Gen4 U.2 drives)
    kv_capacity_tokens: int = 450_000
    chunk_tokens: int = 8192  # max_num_batched_tokens: prompt + decode tokens per iteration

    def chunk_work(self, start: int, end: int) -> float:
        """Token-equivalents of computing prompt positions [start, end): dense + attention."""
        return (end - start) + (end * end - start * start) / self.attention_tokens

    def iteration_s(self, prefill_work: float, batch: int, kv_tokens: int) -> float:
        """One engine iteration: ``prefill_work`` token-equivalents of prompt and one
        token for each of ``batch`` running sequences holding ``kv_tokens``."""
        if batch == 0:
            return self.prefill_base_s + self.per_token_s * prefill_work
        return (
            self.decode_base_s
            + self.decode_per_seq_s * batch
            + self.decode_per_kv_token_s * kv_tokens
            + self.per_token_s * prefill_work
        )

    def transfer_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.link_bytes_per_s

    def fetch_s(self, host_tokens: int, disk_tokens: int) -> float:
        """Loading a prompt's cached KV from host DRAM and from disk to its GPUs."""
        bytes_per_token = self.kv_bytes_per_token
        return bytes_per_token * (host_tokens / self.host_bytes_per_s + disk_tokens / self.disk_bytes_per_s)


__all__ = ["ATTENTION_TOKENS", "KV_BYTES_PER_TOKEN", "CostModel"]
