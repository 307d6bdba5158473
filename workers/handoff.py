"""What a prefill produces for the rest of the fabric: token 0 for the client (with the
prompt usage) and ``PrefillDone`` (with the KV handle) for the scheduler. One place, for
the prefill worker and for a decode worker prefilling a ``LocalTask`` itself."""

from __future__ import annotations

from switchyard.schemas import LocalTask, PrefillDone, PrefillTask, PromptUsage, StreamChunk
from switchyard.workers.engine import HandoffEngine, PrefillEngine, PrefillResult
from switchyard.workers.runtime import WorkerBus


def charged_tokens(task: PrefillTask | LocalTask) -> int:
    """The prompt tokens the scheduler's ledger charged for a prompt it gave this worker (all
    of them, if it did not say): what a role's budget check counts, as the scheduler counts."""
    return task.charged_tokens if task.charged_tokens is not None else len(task.spec.prompt_tokens)


def first_token(worker_id: str, task: PrefillTask, result: PrefillResult) -> tuple[StreamChunk, PrefillDone]:
    spec = task.spec
    # The prompt this run prefilled, a migrated request's output included (``resume_from``):
    # the scheduler's throughput estimate and the ingress's count of recomputed tokens need
    # it; the client's usage comes from the ingress's own spec.
    usage = PromptUsage(
        prompt_tokens=len(spec.prompt_tokens),
        cached_tokens=result.cached_tokens,
        queued_s=task.queued_s,
        prefill_s=result.prefill_s,
        batch_tokens=result.batch_tokens,
    )
    if spec.sampling.decode_samples_first:
        # The prefill's token is not the request's (it was sampled outside the grammar, see
        # ``SamplingParams.decode_samples_first``): the client gets the usage, decode token 0.
        chunk = StreamChunk(request_id=spec.request_id, seq=spec.resume_from, usage=usage)
        done = PrefillDone(
            worker_id=worker_id,
            request_id=spec.request_id,
            handle=result.handle,
            first_token=-1,
            usage=usage,
            finished=False,
        )
        return chunk, done
    # Token 0 ends the request when the engine says so (EOS, a stop token) or when it was all
    # the request asked for; either way no decode follows.
    reason = result.finish_reason or ("length" if spec.sampling.max_tokens <= 1 else None)
    chunk = StreamChunk(
        request_id=spec.request_id,
        seq=spec.resume_from,  # 0, or where a migrated request's client left off
        token_ids=[result.first_token],
        finish_reason=reason,
        usage=usage,
        logprobs=None if result.logprobs is None else [result.logprobs],
    )
    done = PrefillDone(
        worker_id=worker_id,
        request_id=spec.request_id,
        handle=result.handle,
        first_token=result.first_token,
        usage=usage,
        finished=reason is not None,
    )
    return chunk, done


async def announce(
    bus: WorkerBus,
    engine: PrefillEngine,
    tasks: list[PrefillTask],
    results: list[PrefillResult],
    done: list[PrefillDone],
) -> None:
    """Tell the scheduler of prefills whose decode runs elsewhere (``done``), once a
    ``HandoffEngine`` says their KV can be found; their token 0 is out already."""
    if done and isinstance(engine, HandoffEngine):
        await engine.wait_handoff(tasks, results)
    for event in done:
        await bus.event(event)
