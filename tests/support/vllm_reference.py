"""One vLLM engine alone, no connector, no Switchyard: the greedy tokens (and each one's
logprob) every test of the vllm engine compares against. Run as a script (vLLM spawns its engine core, which
re-imports the main module): ``python vllm_reference.py MODEL_DIR IN.json OUT.json``
where IN.json is ``{"prompts": [[token ids], ...], "max_tokens": N}``."""

from __future__ import annotations

import json
import sys


def main(model: str, source: str, target: str) -> None:
    from vllm import LLM, SamplingParams

    request = json.loads(open(source).read())
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=4096,
        block_size=32,
        seed=0,
        enable_prefix_caching=False,
    )
    params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, detokenize=False, logprobs=0)
    outputs = []
    for prompt in request["prompts"]:  # one at a time: the same batch shapes as a lone request
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        completion = out.outputs[0]
        logprobs = [
            position[token].logprob for token, position in zip(completion.token_ids, completion.logprobs, strict=True)
        ]
        outputs.append(
            {"tokens": list(completion.token_ids), "finish_reason": completion.finish_reason, "logprobs": logprobs}
        )
    open(target, "w").write(json.dumps(outputs))


if __name__ == "__main__":
    main(*sys.argv[1:4])
