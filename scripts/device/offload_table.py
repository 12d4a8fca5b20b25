"""The table of `offload_curve.sh`'s points: step times, item-table cache traffic per step."""

import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
print(
    f"{'point':6s} {'med ms':>7s} {'b2b ms':>7s} {'hits':>8s} {'misses':>8s} {'h2d MB':>7s} {'d2h MB':>7s} "
    f"{'stage ms':>8s}  compile"
)
for point in sys.argv[2:]:
    text = (out / f"{point}.log").read_text() if (out / f"{point}.log").exists() else ""
    if "{\n" not in text:
        print(f"{point:6s} no result")
        continue
    r = json.loads(text[text.index("{\n") : text.rindex("}") + 1])
    c = r["cache_per_step"] or {}

    def get(key: str) -> float:
        return c.get(f"embeddings/items/{key}", 0.0)

    print(
        f"{point:6s} {1e3 * r['device_step_s_median']:7.1f} {1e3 * r['step_s_back_to_back']:7.1f} "
        f"{get('cache_hits'):8.0f} {get('cache_misses'):8.0f} {get('host_to_device_bytes') / 1e6:7.1f} "
        f"{get('device_to_host_bytes') / 1e6:7.1f} {1e3 * (r.get('host_stage_s_median') or 0):8.1f}  "
        f"{r['compile_s']:.0f} s, fresh batches {r['every_step_a_new_batch']}"
    )
