"""llama.cpp as a decode-speed peer: run by ``skipdecode bench --llamacpp`` with the llama.cpp
virtualenv's python (it never imports skipdecode, and skipdecode never imports llama_cpp).

    LLAMA_CPP_LIB_PATH=.venv-llamacpp/build/bin .venv-llamacpp/bin/python llamacpp_offline.py \\
        GGUF NEW_TOKENS REPEATS THREADS BATCH[,BATCH...] < prompts.json

stdin: a JSON list of prompt token-id lists (the same ids skipdecode decodes; the GGUF is converted
from the same Hugging Face directory, so the vocabularies agree). Batch b decodes sequences
0..b-1 in one ``llama_batch`` per step, each with its own sequence id, greedy (llama.cpp's own
greedy sampler), EOS ignored. stdout, last line: JSON ``{"batches": {b: {"t_decode": [...]}},
"tokens": [...]}``: per repeat, the seconds of the ``NEW_TOKENS - 1`` decode steps after the
prefill (timed from the first token on, as the bench times skipdecode), and the greedy tokens
of sequence 0 at batch 1 (checked against skipdecode's).
"""

import json
import sys
import time


def main() -> None:
    import llama_cpp as L

    gguf, n, repeats, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    batches = [int(b) for b in sys.argv[5].split(",")]
    prompts = json.loads(sys.stdin.read())
    L.llama_backend_init()
    quiet = L.llama_log_callback(lambda level, text, data: None)  # kept alive while llama.cpp runs
    L.llama_log_set(quiet, None)
    model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp could not load {gguf}")
    B_max = max(batches)
    P = max(len(p) for p in prompts)
    per_seq = P + n + 16
    cp = L.llama_context_default_params()
    cp.n_ctx = per_seq * B_max
    cp.n_batch = cp.n_ubatch = max(P * B_max, B_max)
    cp.n_seq_max = B_max
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise SystemExit("llama.cpp could not create a context")
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(cp.n_batch, 0, 1)
    sampler = L.llama_sampler_init_greedy()

    def put(i: int, tok: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, logits

    def run(b: int, k: int) -> tuple[list[int], float]:
        """Prefill b prompts in one batch, then k - 1 decode steps of b rows; greedy.
        Returns row 0's tokens and the seconds of the decode steps alone."""
        L.llama_memory_clear(mem, True)
        seqs = [prompts[s % len(prompts)] for s in range(b)]
        i, last = 0, []
        for s, p in enumerate(seqs):
            for j, t in enumerate(p):
                put(i, t, j, s, j == len(p) - 1)
                i += 1
            last.append(i - 1)
        batch.n_tokens = i
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed on the prompts")
        toks = [L.llama_sampler_sample(sampler, ctx, idx) for idx in last]
        out = [toks[0]]
        pos = [len(p) for p in seqs]
        t0 = time.perf_counter()
        for _ in range(k - 1):
            for s in range(b):
                put(s, toks[s], pos[s], s, True)
                pos[s] += 1
            batch.n_tokens = b
            if L.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama_decode failed on a decode step")
            toks = [L.llama_sampler_sample(sampler, ctx, s) for s in range(b)]
            out.append(toks[0])
        return out, time.perf_counter() - t0

    tokens, _ = run(1, n)
    res = {}
    for b in batches:
        run(b, 4)  # warm-up
        res[str(b)] = {"t_decode": [run(b, n)[1] for _ in range(repeats)]}
    L.llama_sampler_free(sampler)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    print(json.dumps({"batches": res, "tokens": tokens, "version": L.__version__,
                      "system_info": L.llama_print_system_info().decode().strip(),
                      "kv_types": [int(cp.type_k), int(cp.type_v)]}))  # ggml types: 0 F32, 1 F16


if __name__ == "__main__":
    main()
