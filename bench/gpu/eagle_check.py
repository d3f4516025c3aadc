"""The GPU line of issue 35: reads bench/speculative.py's --json report (batch 1, greedy) and prints
PASS when the fastest speculative run is at least 2x plain decoding's tokens/s, else FAIL (exit 1).

Usage: python bench/gpu/eagle_check.py REPORT.json
"""

import json
import sys

LINE = 2.0


def main(path: str) -> int:
    runs = json.load(open(path))["runs"]
    plain = next(r["tokens_per_s"] for r in runs if r["run"] == "plain")
    best = max((r for r in runs if r["run"] != "plain"), key=lambda r: r["tokens_per_s"])
    ratio = best["tokens_per_s"] / plain
    verdict = "PASS" if ratio >= LINE else "FAIL"
    print(
        f"EAGLE, CUDA, batch 1 greedy: {best['run']} {ratio:.2f}x plain "
        f"(mean acceptance length {best.get('mean_acceptance_length')}; line: >= {LINE}x): {verdict}"
    )
    return 0 if ratio >= LINE else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
