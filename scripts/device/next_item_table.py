"""Valid and test full NDCG@10 / HR@10 of the next-item runs under a folder, one line per run."""

import json
import sys
from pathlib import Path


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in (d or {}).items():
        out.update(flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


root = Path(sys.argv[1])
print(
    f"{'run':28s} {'vN@10':>7s} {'tHR@10':>7s} {'tN@10':>7s} {'epoch':>6s} {'evals':>5s} {'last valid':>10s}"
)
for wd in sorted(p for p in root.iterdir() if p.is_dir()):
    metrics = wd / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    evals = [flat(r["valid"])["full/NDCG@10"] for r in map(json.loads, lines) if r.get("split") == "valid"]
    last = f"{evals[-1]:10.4f}" if evals else f"{'-':>10s}"
    if not (wd / "test.json").exists():
        print(f"{wd.name:28s} no test.json; {len(evals)} evaluations, last {last}")
        continue
    r = json.loads((wd / "test.json").read_text())
    v, t = flat(r["valid"]), flat(r["test"])
    print(
        f"{wd.name:28s} {v['full/NDCG@10']:7.4f} {t['full/HR@10']:7.4f} {t['full/NDCG@10']:7.4f} "
        f"{r.get('epoch', r['step'])!s:>6s} {len(evals):5d} {last}"
    )
