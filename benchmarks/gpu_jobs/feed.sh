#!/usr/bin/env bash
# fit's device feed, input_transform and resnet18_bench --loader on one CUDA GPU (3-4 minutes on an H200, 240 s at most).
# Run from the repository root; everything is written under $OUT.
set -u
: "${OUT:?set OUT to the folder for the logs}"
mkdir -p "$OUT"
export PYTHONPATH=.
PY=${PYTHON:-python}

# 1. The CUDA tests of the input pipeline and of the files around it (~45 s): feed on/off bit for bit (fp32, bf16;
#    float32 and uint8; pinned and not), nested dict batches, errors from the loader and the model mid-epoch,
#    memory after fit, exact resume with the feed; the --loader mode on CUDA.
timeout 70 $PY -m pytest -q -m gpu tests/test_input.py tests/test_recipes.py tests/test_bad_input.py \
    > "$OUT/feed-tests.txt" 2>&1
echo "pytest exit code: $?" >> "$OUT/feed-tests.txt"

# 2. The reference setup (~90 s; each loader's table is printed, and the JSON rewritten, as it is done): ResNet18, batch 128, bf16, fused SGD, 2,048 in-memory 224x224 images, 6 workers,
#    pinned and unpinned, float32 and uint8 (normalised on the device); fit with the feed and without, beside the
#    resident step, a hand loop and the loader alone; 3 rounds.
timeout 125 $PY -m precisionloop.recipes.resnet18_bench --loader --precisions bf16 --batch-sizes 128 \
    --images 2048 --workers 6 --pin-memory both --image-dtypes float32,uint8 --rounds 3 \
    --json "$OUT/feed-loader.json" > "$OUT/feed-loader.txt" 2> "$OUT/feed-loader.err"
echo "loader mode exit code: $?" >> "$OUT/feed-loader.txt"

# 3. The feed alone (~25 s): fit over 16 batches already in host memory (no loader wait, so the copy is all the
#    input costs), feed on and off alternating over 5 rounds, ms per step and the per-round ratio.
timeout 45 $PY - "$OUT/feed-alone.json" > "$OUT/feed-alone.txt" 2>&1 <<'PYEOF'
import json, statistics, sys, time

import torch
import torchvision

from precisionloop import Trainer, normalize_uint8

norm = normalize_uint8((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
g = torch.Generator().manual_seed(0)
u8 = [torch.randint(0, 256, (128, 3, 224, 224), dtype=torch.uint8, generator=g) for _ in range(16)]
labels = [torch.randint(0, 1000, (128,), generator=g) for _ in range(16)]
rows = []
print("fit over 16 host batches of 128 at 224x224, ResNet18 bf16, fused SGD; ms/step median [min-max] of 5 rounds")
for images in ("float32", "uint8"):
    xs = [norm(x) for x in u8] if images == "float32" else u8
    for pinned in (True, False):
        data = [(x.pin_memory(), y.pin_memory()) if pinned else (x, y) for x, y in zip(xs, labels)]
        trainers = {}
        for feed in (True, False):
            torch.manual_seed(0)
            model = torchvision.models.resnet18()
            t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), "bf16", device="cuda",
                        input_transform=norm if images == "uint8" else None)
            t.fit(data, epochs=1, progress=False, device_feed=feed)  # warm-up: cuDNN's choice, the caches
            trainers[feed] = t
        ms = {True: [], False: []}
        for r in range(5):
            for feed in ((True, False) if r % 2 == 0 else (False, True)):
                t = trainers[feed]
                torch.cuda.synchronize()
                began = time.perf_counter()
                t.fit(data, epochs=t.epoch + 1, progress=False, device_feed=feed)
                torch.cuda.synchronize()
                ms[feed].append(1000 * (time.perf_counter() - began) / len(data))
        ratios = [a / b for a, b in zip(ms[True], ms[False])]
        row = {"images": images, "pinned": pinned, "feed_ms": ms[True], "no_feed_ms": ms[False], "ratios": ratios}
        rows.append(row)
        fmt = lambda v: f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]"
        print(f"{images:>7} {'pinned' if pinned else 'unpinned':>8}: feed {fmt(ms[True])}, no feed {fmt(ms[False])}, "
              f"feed / no feed {statistics.median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}]", flush=True)
        del data, trainers
with open(sys.argv[1], "w") as f:
    json.dump(rows, f, indent=2)
PYEOF
echo "feed-alone exit code: $?" >> "$OUT/feed-alone.txt"
