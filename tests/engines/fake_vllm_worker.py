"""A stand-in for optkit/engines/vllm_worker.py that speaks its protocol without vLLM: it runs the
model as the gate's transformers path does (quant/formats/load.py, float32) in optkit's own venv.
FAKE_VLLM_MODE picks a misbehaviour: ok (default), old (vLLM 0.31 in hello), die_on_score,
garbage (a non-JSON reply to load), hang (never answers load), refuse (vLLM's log of a refused
load, then its generic error)."""

import json
import os
import sys
import time

MODE = os.environ.get("FAKE_VLLM_MODE", "ok")


def reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def dense_logprobs(model, windows):
    import torch

    with torch.inference_mode():
        return torch.log_softmax(model(windows).logits[:, :-1].float(), dim=-1)


def main() -> None:
    from safetensors.torch import load_file, save_file

    reply(
        {"event": "hello", "protocol": 1, "vllm": "0.31.0" if MODE == "old" else "0.32.0", "torch": "x", "python": "x"}
    )
    model = None
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "shutdown":
            reply({"ok": True, "op": op})
            return
        if op == "load":
            if MODE == "garbage":
                print("INFO 12-01 loading the model")
                continue
            if MODE == "hang":
                time.sleep(3600)
            if MODE == "refuse":
                for text in (
                    "ERROR 12-01 19:19:57 [core.py:1] RuntimeError: cpu_gemm_wna16 not implemented for 'Float'",
                    "RuntimeError: Engine core initialization failed. See root cause above.",
                ):
                    print(f"(EngineCore pid=1) {text}", file=sys.stderr, flush=True)
                reply(
                    {
                        "ok": False,
                        "op": op,
                        "error": "RuntimeError: Engine core initialization failed. "
                        "See root cause above. Failed core proc(s): {'EngineCore': 1}",
                    }
                )
                continue
            from optkit.quant.formats.load import load_model

            model = load_model(request["model"])
            vocab = model.config.vocab_size
            reply(
                {
                    "ok": True,
                    "op": op,
                    "vocab_size": vocab,
                    "dtype": request["dtype"],
                    "quantization": None,
                    "load_s": 0.0,
                }
            )
            continue
        windows = load_file(request["windows"])["windows"]
        if MODE == "die_on_score":
            print("Fatal Python error: Segmentation fault in cpu_gemm_wna16", file=sys.stderr, flush=True)
            os._exit(139)
        logp = dense_logprobs(model, windows)
        target = logp.gather(-1, windows[:, 1:].unsqueeze(-1)).squeeze(-1)
        if op == "score":
            ids = load_file(request["ids"])["ids"]
            tensors = {
                "logp_at_ids": logp.gather(-1, ids).contiguous(),
                "target_logp": target,
                "argmax": logp.argmax(-1),
            }
        else:
            tensors = {"logp": logp.contiguous(), "target_logp": target}
        save_file(tensors, request["out"])
        reply({"ok": True, "op": op, "out": request["out"], "seconds": 0.0})


if __name__ == "__main__":
    main()
