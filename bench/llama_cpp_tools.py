"""llama.cpp's command-line tools, as bench/build_llama_cpp_tools.sh builds them from the sources
vendored in llama-cpp-python's sdist: llama-imatrix (an importance matrix from calibration text),
llama-quantize (its per-tensor mixes, with or without that matrix: `llama_model_quantize`'s
`imatrix` parameter was a C++ map that ctypes could not build; bench/llama_cpp_quantizer.py does
both in process now), llama-perplexity (its own perplexity and --kl-divergence, a cross-check on its
own chunks of the text) and llama-bench (decode speed, by hand).

The tools are looked up in $OPTKIT_LLAMA_CPP_TOOLS, else .cache/llama.cpp-tools/bin of the checkout.
"""

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD_HINT = "build them with bench/build_llama_cpp_tools.sh (or point OPTKIT_LLAMA_CPP_TOOLS at their folder)"


def tools_dir() -> Path:
    return Path(os.environ.get("OPTKIT_LLAMA_CPP_TOOLS") or ROOT / ".cache" / "llama.cpp-tools" / "bin")


def tool(name: str) -> Path:
    path = tools_dir() / name
    if not os.access(path, os.X_OK):
        raise SystemExit(f"{path} is missing: {BUILD_HINT}")
    return path


def _run(name: str, *args: str | Path) -> subprocess.CompletedProcess:
    command = [str(tool(name)), *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-15:])
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{tail}")
    return done


def imatrix(model: Path, text: Path, out: Path, threads: int, seq_len: int, chunks: int) -> Path:
    """llama-imatrix over `chunks` chunks of `seq_len` tokens of `text` (its own tokenization)."""
    _run(
        "llama-imatrix", "-m", model, "-f", text, "-o", out, "-c", seq_len, "-b", seq_len,
        "--chunks", chunks, "--no-ppl", "-t", threads,
    )  # fmt: skip
    return out


def quantize(source: Path, out: Path, qtype: str, threads: int, importance: Path | None = None) -> Path:
    """llama-quantize's mix `qtype` (e.g. Q4_K_M) of `source`, with the importance matrix when given."""
    _run("llama-quantize", *(["--imatrix", importance] if importance else []), source, out, qtype, threads)
    return out


def kld_base(model: Path, text: Path, out: Path, threads: int, seq_len: int) -> Path:
    """llama-perplexity's record of `model`'s log-probabilities on `text`, in chunks of `seq_len`."""
    _run("llama-perplexity", "-m", model, "-f", text, "-c", seq_len, "-b", seq_len, "--kl-divergence-base", out,
         "-t", threads)  # fmt: skip
    return out


def perplexity_kld(model: Path, base: Path, threads: int, seq_len: int) -> dict:
    """llama-perplexity --kl-divergence of `model` against the kld_base record: its perplexity and
    mean KLD over the second half of every chunk (the tokens it scores)."""
    out = _run("llama-perplexity", "-m", model, "--kl-divergence-base", base, "--kl-divergence",
               "-c", seq_len, "-b", seq_len, "-t", threads)  # fmt: skip
    out = out.stdout + out.stderr
    ppl = re.search(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", out)
    kld = re.search(r"Mean\s+KLD:\s*([0-9.]+)", out)
    if not ppl or not kld:
        raise RuntimeError(f"llama-perplexity printed no Mean PPL(Q) / Mean KLD for {model}:\n{out[-2000:]}")
    return {"ppl": float(ppl.group(1)), "kld_mean": float(kld.group(1))}


def version() -> str:
    """The llama-cpp-python version whose sources the tools were built from."""
    path = tools_dir() / "VERSION"
    return path.read_text().strip() if path.exists() else "unknown"
