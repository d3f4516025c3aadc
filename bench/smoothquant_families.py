"""SmoothQuant W8A8 against plain W8A8 on the tiny random model of each family that has a
smoothing group (tests/tiny_families.py), with and without activation outliers.

Prints family × outliers × method -> mean KLD against the model's own full precision on 48 held-out
windows of 64 tokens spread over the whole held-out set, through optkit's runtime, the ratio to plain
W8A8 measured in the same run, and
the paired per-window difference from it ± its standard error (tests/quant/paired_kld.py: the tiny
models' W8A8 artifacts differ by less than a few windows' noise). The outlier copy scales a few
channels of every norm that feeds linears by 32 and divides the matching input columns of the
linears by 32 (the same function).

Usage: python bench/smoothquant_families.py [--families gemma2 phi3 ...] [--alphas 0.5 auto] [--json]
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/tiny_families.py

from optkit.families import family_for  # noqa: E402
from optkit.modeldir import resolve_model_dir  # noqa: E402
from optkit.quant.calibration_data import CalibrationOptions  # noqa: E402
from optkit.quant.methods.smoothquant.options import SmoothQuantOptions  # noqa: E402
from optkit.quant.quantize import QuantizeOptions, quantize_model  # noqa: E402
from optkit.weights.schemes import WeightScheme  # noqa: E402
from tests.quant.paired_kld import heldout_windows, window_klds  # noqa: E402
from tests.tiny_families import save_tiny_family  # noqa: E402

FAMILIES = ("llama", "qwen2", "qwen3", "granite", "phi3", "gemma2", "gemma3_text")
W8_CHANNEL = WeightScheme(bits=8, group_size=-1, symmetric=True)
CALIB = CalibrationOptions(num_samples=32, seq_len=64)
OUTLIER_CHANNELS, OUTLIER_FACTOR = (3, 40, 77, 101), 32.0


def with_outliers(path: Path, out: Path) -> Path:
    """The same function with a few outlier channels on every norm that feeds linears."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    tensors = load_file(out / "model.safetensors")
    family = family_for(json.loads((path / "config.json").read_text())["model_type"])
    offset = family.norm_weight_offset  # Gemma's (1 + w): w ← (1 + w)·c − 1
    prefix = next(k for k in tensors if ".layers.0." in k).split(".layers.0.")[0]
    channels = list(OUTLIER_CHANNELS)
    layers = {int(k.split(".layers.")[1].split(".")[0]) for k in tensors if ".layers." in k}
    for layer in layers:
        for norm, linears, _ in family.norm_groups:
            w = tensors[f"{prefix}.layers.{layer}.{norm}.weight"]
            w[channels] = (offset + w[channels]) * OUTLIER_FACTOR - offset
            for linear in linears:
                tensors[f"{prefix}.layers.{layer}.{linear}.weight"][:, channels] /= OUTLIER_FACTOR
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def measure(family: str, outliers: bool, alphas: list, tmp: Path) -> list[dict]:
    base = save_tiny_family(family, tmp / family, resolve_model_dir("draft"))
    if outliers:
        base = with_outliers(base, tmp / f"{family}-outliers")
    windows = heldout_windows(base)
    rows, plain = [], None
    for method, alpha in [("w8a8", None)] + [("smoothquant", a) for a in alphas]:
        out = tmp / f"{base.name}-{method}-{alpha}"
        sections = {"smoothquant": SmoothQuantOptions(alpha=alpha)} if alpha is not None else {}
        quantize_model(base, out, QuantizeOptions(method=method, weights=W8_CHANNEL, calibration=CALIB, **sections))
        klds = window_klds(base, out, windows)  # per window
        plain = klds if plain is None else plain
        diff = klds - plain  # paired with plain W8A8, window by window
        rows.append({"family": family, "outliers": outliers, "method": method, "alpha": alpha,
                     "kld_mean": klds.mean().item(), "vs_w8a8": (klds.mean() / plain.mean()).item(),
                     "diff": diff.mean().item(), "diff_se": (diff.std() / len(diff) ** 0.5).item()})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--alphas", nargs="+", default=["0.5", "auto"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    alphas = [a if a == "auto" else float(a) for a in args.alphas]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            for outliers in (False, True):
                rows += measure(family, outliers, alphas, Path(tmp))
                if not args.json:
                    for r in rows[-1 - len(alphas) :]:
                        print(
                            f"| {r['family']} | {'yes' if r['outliers'] else 'no'} | {r['method']} | "
                            f"{'' if r['alpha'] is None else r['alpha']} | {r['kld_mean']:.3e} | {r['vs_w8a8']:.3f}× | "
                            f"{r['diff']:+.2e} ± {r['diff_se']:.2e} |",
                            flush=True,
                        )
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
