"""The llama.cpp peer's process (app/peer.py starts it with the peer build first on PYTHONPATH).

Protocol, one JSON object per line: first {"model", "n_ctx", "threads"}, answered with
{"system_info"}; then {"prompt", "n_gen", "context"} per timing request, answered with
{"prompt_s", "ttft_s", "decode_s"}; an {"error"} answers a request that failed. EOF ends it.
"""
from __future__ import annotations

import json
import sys


def main() -> int:
    import llama_cpp

    from app.bench import time_decode, time_prefill
    from core.engine import Engine

    engine = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if engine is None:
                engine = Engine(request["model"], backend="llama.cpp", n_ctx=request["n_ctx"],
                                threads=request["threads"], device="cpu")
                answer = {"system_info": llama_cpp.llama_print_system_info().decode(),
                          "llama_cpp": llama_cpp.__file__}
            else:
                prompt_s, ttft_s = time_prefill(engine, request["prompt"])
                decode_s = time_decode(engine, request["prompt"][0], request["n_gen"], request["context"])
                answer = {"prompt_s": prompt_s, "ttft_s": ttft_s, "decode_s": decode_s}
        except Exception as e:  # noqa: BLE001 - reported to the bench, which raises it
            answer = {"error": str(e) or type(e).__name__}
        print(json.dumps(answer), flush=True)
    if engine is not None:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
