#!/usr/bin/env bash
# The benchmark on the 2 x H200 machine, in calls that each fit the 10-minute limit.
# Each call is `bash bench/device.sh <phase> <seconds>` with `.whl` carried (bash ../shared/device/wheels.sh
# here first); results land in $OUT and in /tmp/lorapipe-keep, which later calls on the same warm
# machine read with --skip-done. A cold machine rebuilds what it needs, and knows only what bench/results/
# holds: copy a call's JSON there (bench/results/bench-<family>-<phase><letter>.json) before calling that
# phase again, or a fresh machine measures the same rows again (O3c of 2026-12-02 repeated O3b's).
#   A: FLUX on GPU 0 and Qwen-Image on GPU 1, side by side (one process per GPU)
#   B: the nf4 1-vs-2-GPU FLUX run (both GPUs), then FLUX (cont.) on GPU 0 and Z-Image on GPU 1
#   C: FLUX (cont.) on GPU 0, SDXL then Z-Image (cont.) on GPU 1
#   D: what A-C left (items ok in bench/results/ are skipped): FLUX then Z-Image on GPU 0, SDXL on GPU 1
#   E: what A-D left: Qwen-Image on GPU 0, SDXL (cont.) then Z-Image (cont.) on GPU 1
#   F: nf4 with compile forced on, every family (= auto since then) (Qwen-Image then FLUX on GPU 0, Z-Image then SDXL on GPU 1)
# One-GPU calls for what the 2026-12-01 calls left unmeasured (carry .whl and, for G/H, .carry-peers):
#   G: FLUX.2 klein: the dtype fix's A/B (bench/dtype_probe.py), then the side-by-side with diffusers' script again
#   G2: the klein side by side alone: nf4, then nf4 and nf4 + cuDNN attention within the script's peak (fitpeer:
#       partial checkpointing with the script's peak as the budget; not yet run)
#   G3: G2's product rows again (G2 of 2026-12-02: peers.py ran main() above _status, so both
#       fitpeer rows died in a NameError that hid their log), beside fitreserved (the script's reserved peak as the
#       cap), then plain cuDNN
#   G4: G3's capped rows after its finding (a capture without room under the cap ran out of memory, and the eager
#       steps after it): "auto" now captures only with room under the budget, and the planner checkpoints more
#       blocks to leave it (memory._with_graph_room); first the CUDA tests of the room check (never run on a GPU)
#   H: FLUX.1 Kontext side by side with diffusers' script (its base is bf16: the product's nf4 and bf16 rows)
#   I: Qwen-Image 2.1 then Krea 2: their core rows (encode, latents, nf4/bf16 512 b1, export + verify)
#   I2: Krea 2's rows of I again (I's full-size folder tapped the tiny model's 2 text layers, not the 12 its
#       transformer takes: its train failed; full.py PIPELINE_EXTRA now sets them)
#   I3: the rest of Qwen-Image 2.1's then Krea 2's plans (bf16, 1024 px, batch 4, fp8; what bench/results holds is skipped)
#   I4, I5, O3, O4: I3's and O2's families one a call, each with the call's whole time (a family's remaining plan
#       is ~8 train items of 60-95 s; half a call got 2-3 of them); --keep leaves the built model in /dev/shm for
#       a next call on the warm machine (without it K9 rebuilt FLUX, 59 s): call the same phase again to go on
#   I6: Qwen-Image 2.1's nf4 512 px b1 train again, after its layout forward let CUDA graphs capture (commit 4bac159;
#       run by this bench.py line by hand with its last ~200 s: bench-qwen-image-2.1-I6.json)
#   I8: Qwen-Image 2.1's other train rows again under graphs (I4's ran eager), 1024 px first (bf16 1024 b4 and fp8
#       had never run), then 512 px
#   P: FLUX.1 Kontext side by side again, the product's rows with cuDNN attention (never run for Kontext; on klein it
#      halved attention's time); P1: the same product rows alone, beside the script's row of run3 (--peer-row)
#   KA: FLUX.2 klein product-only probe (the script's row from G4): fp8 with cuDNN attention and fp8, every block
#       checkpointed, at the side by side's 512 text tokens (the bench's fp8 1024 b1 ran 0.209 s at 77 tokens)
#   KB: KA's finding (fp8 + cuDNN 0.201 s at 5.82 GB, over the script's 5.09) as a plan: the script, then fp8 within its
#       peak (the planner keeps the first blocks fp8, the rest nf4: stages/core/fp8.py quantize_fp8_nf4) with and
#       without cuDNN attention, beside nf4 + cuDNN within it (G4's best row); first the mixed base's CUDA test
#   KC: KB's capped fp8 rows ran out of memory at the 5.08 GB cap (the planner had 16 fp8 blocks at 4.49 GB; the whole
#       fp8 base measured 5.82 allocated against its 5.26 predicted): the script, then fp8 + cuDNN with the first 16, 14
#       and 12 blocks fp8 (train.fp8_blocks, the rest nf4), uncapped, compared allocated to allocated
#   KE: KC's best row (16 fp8 blocks, 4.93 GB allocated against the script's 5.09) with 18, the most that may stay under
#       its allocated peak (~0.056 GB a single block); not run: KF holds it
#   KF: probes first (bench/fp8_tiny_probe.py: the tiny fp8 LoRA step's NaN; bench/sdpa_probe.py: where cuDNN SDPA
#       dies), then KE's run with 18 and 17 fp8 blocks
#   KG: bench/cudnn_flux_probe.py (cuDNN inside a FLUX.1-width transformer at Kontext's tokens), then Kontext side by
#       side with fp8 + cuDNN (the script, fp8 + cuDNN within its peak, fp8 + cuDNN)
#   KH: KG's probe crashed inside the model where bench/sdpa_probe.py's same shapes ran: torch caches cuDNN's
#       attention backward by q/k/v layout only, and FLUX.1's single blocks hand it a sliced output gradient under
#       the double blocks' key (tests/test_runtime_flags.py). The train stage's guard (runtime.cudnn_safe_sdpa: one
#       gradient layout) in the probe, then Kontext side by side: the script, fp8 + cuDNN within its peak, fp8 + cuDNN
#   KM: cuDNN's attention gradients against flash's (bench/cudnn_flux_probe.py: FLUX.1 at the tiny test models' widths
#       and tokens, with and without the guard, and at Kontext's 8,704 tokens), since KK found the tiny models' NaN
#       under cuDNN with the guard too; then Kontext's keep_attention rows without cuDNN (flash), product only; first
#       the tiny fp8 tests on the GPU again (their step now under the train stage's flags)
#   KO: why KN's planned rows ran out of memory at the cap before their first step (5.65 GB reserved of 5.74): the
#       planner's own choice (22 fp8 blocks) uncapped, for its allocated and reserved peaks; the capped row again,
#       now keeping its last events; the same without CUDA graphs (product only; the script's row from KN)
#   KS: KR's klein rows first (KR's pytest ran out its 240 s on the tiny model's torch.compile: the first case passed,
#       the second never finished; the product rows were cut off by the budget), then that test with compile off
#   KR: first the CUDA test that a capped stage runs with expandable segments (and the user's setting wins), and
#       the cuDNN probe at the tiny test models' own 32 tokens (KM's tiny case had 48); then
#       klein beside its script under its reserved peak as the cap, now with expandable segments there and the
#       planner keeping fewer fp8 blocks for the CUDA graph's room (9 of 25 planned), and 17 fp8 blocks set by hand
#       under the same cap (does the runtime find room for the capture: KP found 2.10 GB free at 22, 2.33 wanted)
#   KP: KO's capped row with expandable segments (PYTORCH_CUDA_ALLOC_CONF), with and without CUDA graphs
#   KQ: the planner's 22 fp8 blocks uncapped with expandable segments: do CUDA graphs capture with them, how fast
#   KN: klein beside its script with the planner choosing the fp8 blocks itself under the script's reserved peak as
#       the cap (`bench/memory.py plan` plans 22 of 25 fp8 blocks at 5.74 GB, 5.12 predicted; measured by hand so
#       far: 18 blocks, 5.04 GB allocated and 6.36 reserved uncapped), with and without cuDNN
#   KK: the tiny fp8 probe's attention modes (the tests' NaN with torch's own SDPA choice, cuDNN's, against the
#       train stage's flags and the guard), then Kontext side by side with train.keep_attention (checkpointed
#       blocks keep their attention outputs) on fp8 + cuDNN, within the script's peak and all checkpointed
#   KI: the tiny fp8 probe (now tests/test_fp8.py's own step, bf16 first as the test) and those tests on the GPU, then
#       KF's klein rows again with the guard (it copies the single blocks' sliced gradient: ~28 MB each at 1024 px)
#       the candidate fix (bench/cudnn_flux_probe.py cudnn_safe_sdpa: dense q/k/v and output gradient) eager and
#       checkpointed, and a half-length control; not run yet (the device time ran out)
#       gradient) in the probe, then Kontext's fp8 + cuDNN within the script's peak, product only (KG's script row)
#   I9: Krea 2's last bf16/nf4 row (bf16 1024 b4), then its fp8 1024 b1
#   O6: what O4 left for Qwen-Image-Edit-Plus (bf16 1024 b4, fp8 1024 b1), then FLUX.2 klein's bf16 1024 b4
#   KL: FLUX.2 klein's own plan (bench/results holds its encode, 512 px latents and nf4
#       512 px b1 train/export/verify only; bf16 at every shape, nf4 1024 px and batch 4, 1024 px latents never ran
#       here, its 1024 px b1 rows being the side by side's, bench/results/peers-klein-*.json)
#   J: FLUX.2 [dev] built one component at a time (bench/staged.py): encode, latents, nf4 train, export, verify, then
#      bf16 (61.8 GB planned at 512 px b1: it fits the H200) and the rest of its plan; call it again to go on (--keep).
#      2026-12-02 (four calls): every train row; the export was SIGKILLed by the host's OOM killer
#      (export --verify held 70 GB of fp32 deltas: fixed since), so what J has left is the export and its load check
#   SM: the sample stage's memory plans on CUDA (tests/test_sample_memory.py -k cuda: the tiny FLUX pipeline loaded
#       in nf4 through PipelineQuantizationConfig, in bf16 through device_map="cuda" and in bf16 offloaded, each
#       rendering; never run on a GPU), then J (FLUX.2 dev's export and its load check: what
#       J has left)
#   K: fp8 beside bf16 on Qwen-Image (its 1024 b1 target) and the text-encoder offload CUDA test
#   K3: the Qwen-Image fp8 target in one run: bf16 and fp8 at 1024 px b1, then fp8 at 512 px b1
#   K4: fp8 rows for Z-Image then SDXL at 1024 and 512 px b1 (their bf16 rows are in bench/results)
#   K5: the fp8 CUDA tests, then Qwen-Image at 512 px b1, bf16 and fp8 in one run, then both profiled (bench/profile_step.py)
#   K6: the fp8 CUDA tests again (K5 found the trainer-path test's last part training on caches encoded in another
#       precision: fixed, unverified), then FL
#   K7: the fp8 rows not yet measured (each shape of 512/1024 px, batch 1/4) for Z-Image then SDXL
#   K8: the same for Qwen-Image then FLUX.1
#   K9: what K8 left at 512 px (Qwen-Image's model is rebuilt first: ~95 s, so half a call fits none of its rows)
#   F50: bench/fp8.py's fidelity alone over the 50 steps (bf16, nf4, fp8 from one FLUX; 30 measured so far)
#   FL: train's fp8 load on the GPU, streamed against read whole (bench/fp8_load.py; a full-width FLUX with 4 + 8
#       blocks, bf16 then fp32 files): host and GPU peaks
#   A8: FLUX at 16 GB, 1024 px, where "auto" now plans an fp8 base whole (13.37 GB predicted; was nf4): every
#       stage under the budget, and its speed against the 12 GB nf4 and the unconstrained bf16 rows
#   L: torchao float8 against the product's fp8 layer (bench/fp8_torchao.py, torchao from .whl/extra), then
#      FLUX.2 klein 1024 b1 nf4 train A/B: profiled, cuDNN attention (product only; the 2026-12-01 run also had
#      a since-removed LoRA-under-bf16-autocast switch)
#   M: H within all but ~170 s, then T
#   N: H again with the whole call (both sides and the product's rows in one run: 2026-12-01 got them in two
#      calls): the product's fp8 within the script's peak (fitpeer), fp8, bf16, nf4, as time allows
#   O: the edit families' own rows (flux-kontext, then qwen-image-edit): encode, latents, train nf4/bf16, export
#   O2: the rest of the edit families' plans (verify, bf16, batch 4, 1024 px), FLUX.1 Kontext then Qwen-Image-Edit
#   P: Qwen-Image at 8 GB (swap) and auto, each train profiled (train.profile_steps=2): where the swap row's
#      time goes (the 0.50x row), then FLUX at 16/24 GB with train.gradient_checkpointing=auto (partial)
#   Q: block swap into two reused device slots, replayed by CUDA graphs (2026-12-01): the CUDA
#      swap tests, then Qwen-Image at 8 GB (swap), 16 GB (nf4 whole: the swap's overhead) and auto (now bf16: issue
#      16's 0.6x target), then FLUX at 16/24 GB with partial
#      checkpointing (train.gradient_checkpointing=auto) in what is left
#   R: the other swap rows again with the slot swap under CUDA graphs: FLUX at 6 GB and Z-Image at 4 GB, each beside
#      nf4 whole (12 GB, 8 GB) and its unconstrained ("auto": now bf16 where it fits) row
#   S: the memory targets' 512 px rows: Qwen-Image and FLUX at 8/6 GB and auto, then Z-Image and SDXL at 4 GB and auto
#   U: Qwen-Image's unconstrained row (auto: bf16) in Q's harness (Q ran out of time before it), then Z-Image at
#      4 GB (slot swap) beside 8 GB and auto; the Qwen-Image models are deleted first (the 64 GB disk held Qwen-Image
#      but not FLUX beside it in Q)
#   V: FLUX at 6 GB (slot swap) beside 12 GB and auto, then (time left) the swap probe compiled without graphs, 20 steps
#   W: FLUX at 6 and 8 GB, after a change made "auto" leave CUDA graphs off under block swap (V's capture
#      failed at 6 GB and its eager steps then ran out of memory; that W, which also had Qwen-Image
#      at 8 GB, ran out of device time after FLUX's encode and latents), then X on the same built model
#   X: FLUX at 16 and 24 GB with partial checkpointing (train.gradient_checkpointing = auto; Q's attempt found the
#      disk full of its kept Qwen-Image model)
#   Y: the CUDA swap test, then CUDA graphs under block swap where the budget has room (the planner swaps more blocks to
#      leave it, memory.GRAPH_ROOM_MARGIN; the trainer checks it at the capture, fastpath.CaptureRoom; the capture
#      skips the side-stream warmup): FLUX at 6 GB, 512 px (eager ran 0.19x: host-bound), then 6 and 8 GB at 1024 px
#      (eager 0.89x and 0.86x with 43 and 21 blocks swapped; the plans then swapped 54 and 41)
#   Z: the same for Qwen-Image at 8 GB: 512 px (eager 0.16x), 1024 px, and 1024 px with graphs off (its eager speed:
#      the target row's 0.90x ran under graphs)
#   Z2: Z's rows in the order that matters (the memory target first): Qwen-Image at 8 GB, 1024 px (the plan now swaps 47
#       blocks, was 37) then 512 px (eager ran 0.16x)
#   Y2: what Y lost: FLUX at 6 GB, 512 px (Y's row finished its 8 steps and was killed while exiting: memory.py now
#       reads such a row from its final manifest), then Z-Image at 4 GB and auto, 512 px
#   Y3: the 512 px plans the planner's corrected room gives (FLUX at 6 GB 29 swapped, Z-Image at 4 GB
#       12; with 26 and 8 they found 1.90x and 1.70x free at the capture and ran eager), and Z-Image's 512 px auto row
#       (cut off in S and Y2)
#   X2: X again after FLUX.1's single-stream blocks were counted at 13 units un-checkpointed (X's
#       rows allocated 0.84-0.88x their predictions): under "auto" on the H200 fp8 with 54 and 29 of 57 checkpointed
#       predicted (bench/memory.md), every stage under the budget?
#   SP2: FLUX at 6 GB, 512 px, with train.block_swap_layout = "spread" (the swapped blocks among the resident ones,
#       so the copies overlap their compute; its own table), then S3 (SDXL's 512 px rows)
#   SP: Qwen-Image at 8 GB, 512 px, "spread" then "last" on the kept model (with "last" and 27 swapped, under graphs:
#       0.28 s a step, 0.53x; the planner now swaps 28)
#   S2: what S left for Z-Image: 512 px at 4 GB (with the room rule) and auto
#   S3: what S left for SDXL: 512 px at auto, 4 and 8 GB
#   T: bench/tiling.py: what the tiled VAE encode changes in the posterior, every distinct VAE (~150 s)
set -u
phase=$1; secs=${2:-520}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
keep=/tmp/lorapipe-keep; mkdir -p "$keep"
start=$(date +%s)
left() { echo $(( secs - ($(date +%s) - start) )); }
bench() {  # gpu families tag budget [--keep]
  local gpu=$1 fams=$2 tag=$3 budget=$4; shift 4
  local t=$tag l; for l in b c d e f g h; do  # a name bench/results already holds gets the next letter (O3 -> O3d)
    [ -e "bench/results/bench-${fams%%,*}-$t.json" ] || break; t=$tag$l; done; tag=$t
  local skip=(); for f in bench/results/bench-"${fams%%,*}"-*.json "$keep"/bench-"${fams%%,*}"-*.json; do
    [ -e "$f" ] && skip+=(--skip-done "$f"); done
  CUDA_VISIBLE_DEVICES=$gpu python3 bench/bench.py run --families "$fams" --work /tmp/lorapipe-bench-$gpu \
    --out "$OUT/bench-${fams%%,*}-$tag.json" --budget-s "$budget" "${skip[@]}" "$@" > "$OUT/bench-${fams%%,*}-$tag.log" 2>&1
  cp "$OUT/bench-${fams%%,*}-$tag.json" "$keep/" 2>/dev/null
}
# /dev/shm (RAM) keeps this family's model (--keep: a second call on the warm machine goes on with it) and drops
# the other families' (FLUX.2 dev's 64 GB transformer needs the room; O3 and O4 used to drop their own too)
shm_only() { local d; for d in /dev/shm/lorapipe-bench/*; do [ -e "$d" ] && [ "${d##*/}" != "$1" ] && rm -rf "$d"; done; }
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader; df -h /dev/shm /tmp | tail -2
case $phase in
  A) bench 0 flux A $(( $(left) - 40 )) --keep & bench 1 qwen-image A $(( $(left) - 40 )) & wait ;;
  B) python3 bench/multigpu.py run --precisions nf4 --out "$OUT/multigpu-flux-nf4.json" > "$OUT/multigpu.log" 2>&1
     tail -3 "$OUT/multigpu.log"; cp "$OUT/multigpu-flux-nf4.json" "$keep/" 2>/dev/null
     b=$(( $(left) - 40 )); bench 0 flux B $b --keep & bench 1 z-image B $b --keep & wait ;;
  C) b=$(( $(left) - 40 )); bench 0 flux C $b --keep & { bench 1 sdxl C $(( b / 2 )); bench 1 z-image C $(( $(left) - 40 )); } & wait ;;
  D) b=$(( $(left) - 40 )); { bench 0 flux D $(( b * 3 / 4 )) --keep; bench 0 z-image D $(( $(left) - 40 )) --keep; } &
     bench 1 sdxl D $b --keep & wait ;;
  E) b=$(( $(left) - 40 )); bench 0 qwen-image E $b --keep &
     { bench 1 sdxl E $(( b * 2 / 3 )) --keep; bench 1 z-image E $(( $(left) - 40 )) --keep; } & wait ;;
  F) o=(--only '*/train/nf4-*-compile'); b=$(( $(left) - 40 ))
     { bench 0 qwen-image F $(( b * 3 / 5 )) --keep "${o[@]}"; bench 0 flux F $(( $(left) - 40 )) --keep "${o[@]}"; } &
     { bench 1 z-image F $(( b / 2 )) --keep "${o[@]}"; bench 1 sdxl F $(( $(left) - 40 )) --keep "${o[@]}"; } & wait ;;
  G) python3 bench/dtype_probe.py --family flux2-klein --res 1024 --out "$OUT/dtype-probe-klein.json" > "$OUT/dtype-probe.log" 2>&1
     tail -3 "$OUT/dtype-probe.log"; PEERS_BUDGET_S=$(( $(left) - 20 )) bash bench/peers.sh klein 1024 1 15 ;;
  G2) PEERS_BUDGET_S=$(( $(left) - 20 )) bash bench/peers.sh klein 1024 1 15 ;;
  G3) PEERS_PRODUCT=nf4+cudnn+fitpeer,nf4+cudnn+fitreserved,nf4+fitreserved,nf4+cudnn \
        PEERS_BUDGET_S=$(( $(left) - 20 )) bash bench/peers.sh klein 1024 1 15 ;;
  G4) timeout 150 python3 -m pytest -q tests/test_partial_checkpointing.py tests/test_fastpath.py -k cuda > "$OUT/room-cuda.log" 2>&1
      tail -2 "$OUT/room-cuda.log"
      PEERS_PRODUCT=nf4+cudnn+fitpeer,nf4+fitpeer,nf4+cudnn+fitreserved \
        PEERS_BUDGET_S=$(( $(left) - 20 )) bash bench/peers.sh klein 1024 1 15 ;;
  H) PEERS_BUDGET_S=$(( $(left) - 20 )) bash bench/peers.sh kontext 1024 1 15 ;;
  I|I2) o=(--only '*/encode/*' --only '*/latents/512' --only '*/train/nf4-512-b1' --only '*/export/nf4-512-b1'
        --only '*/verify/nf4-512-b1' --only '*/train/bf16-512-b1')
     if [ "$phase" = I ]; then bench 0 qwen-image-2.1 I $(( $(left) / 2 - 20 )) "${o[@]}"; bench 0 krea2 I $(( $(left) - 30 )) "${o[@]}"
     else bench 0 krea2 I2 $(( $(left) - 20 )) "${o[@]}"; fi ;;
  I3) rm -rf /dev/shm/lorapipe-bench/*; bench 0 qwen-image-2.1 I3 $(( $(left) / 2 - 20 )); bench 0 krea2 I3 $(( $(left) - 30 )) ;;
  KL) shm_only flux2-klein; bench 0 flux2-klein KL $(( $(left) - 25 )) --keep ;;
  I4) shm_only qwen-image-2.1; bench 0 qwen-image-2.1 I4 $(( $(left) - 25 )) --keep ;;
  I5) shm_only krea2; bench 0 krea2 I5 $(( $(left) - 25 )) --keep ;;
  I9) shm_only krea2; bench 0 krea2 I9 $(( $(left) - 20 )) --only '*/train/bf16-1024-b4' --only '*/train/fp8-1024-b1' ;;
  I6) python3 bench/bench.py run --families qwen-image-2.1 --work /tmp/lorapipe-bench-0 --out "$OUT/bench-qwen-image-2.1-I6.json" \
        --budget-s $(( $(left) - 15 )) --only '*/encode/*' --only '*/latents/512' --only '*/train/nf4-512-b1' \
        > "$OUT/bench-qwen-image-2.1-I6.log" 2>&1 ;;
  I8) shm_only qwen-image-2.1  # no --skip-done for train rows: I4's ran eager
      q() { python3 bench/bench.py run --families qwen-image-2.1 --work /tmp/lorapipe-bench-0 --keep "$@"; }
      q --out "$OUT/bench-qwen-image-2.1-I8.json" --budget-s $(( $(left) - 15 )) --only '*/train/*-1024-*' \
        > "$OUT/bench-qwen-image-2.1-I8.log" 2>&1
      q --out "$OUT/bench-qwen-image-2.1-I8b.json" --budget-s $(( $(left) - 15 )) --only '*/train/*-512-*' \
        --skip-done bench/results/bench-qwen-image-2.1-I6.json > "$OUT/bench-qwen-image-2.1-I8b.log" 2>&1 ;;
  O6) shm_only qwen-image-edit
      bench 0 qwen-image-edit O6 $(( $(left) - 190 )) --only '*/train/bf16-1024-b4' --only '*/train/fp8-1024-b1'
      rm -rf /dev/shm/lorapipe-bench/qwen-image-edit; bench 0 flux2-klein O6 $(( $(left) - 20 )) --only '*/train/bf16-1024-b4' ;;
  O3) shm_only flux-kontext; bench 0 flux-kontext O3 $(( $(left) - 25 )) --keep ;;
  O4) shm_only qwen-image-edit; bench 0 qwen-image-edit O4 $(( $(left) - 25 )) --keep ;;
  J) shm_only flux2; bench 0 flux2 J $(( $(left) - 30 )) --keep ;;
  SM) timeout 150 python3 -m pytest -q tests/test_sample_memory.py -k cuda > "$OUT/sample-cuda.log" 2>&1
      tail -3 "$OUT/sample-cuda.log"; exec bash "$0" J $(( $(left) - 5 )) ;;
  K) timeout 120 python3 -m pytest -q -x tests/test_text_offload.py -k cuda > "$OUT/offload-cuda.log" 2>&1; tail -2 "$OUT/offload-cuda.log"
     bench 0 qwen-image K $(( $(left) - 30 )) --only 'qwen-image/train/fp8-1024-b1' --only 'qwen-image/train/bf16-1024-b1' ;;
  K3) w=(--work /tmp/lorapipe-bench-0 --keep)  # no --skip-done: bf16 beside fp8 in the same run
     python3 bench/bench.py run --families qwen-image "${w[@]}" --out "$OUT/bench-qwen-image-K3.json" --budget-s $(( $(left) - 25 )) \
       --only 'qwen-image/train/bf16-1024-b1' --only 'qwen-image/train/fp8-1024-b1' --only 'qwen-image/train/fp8-512-b1' \
       > "$OUT/bench-qwen-image-K3.log" 2>&1 ;;
  K4) o=(--only '*/train/fp8-1024-b1' --only '*/train/fp8-512-b1')
     bench 0 z-image K4 $(( $(left) / 2 )) "${o[@]}"; bench 0 sdxl K4 $(( $(left) - 25 )) "${o[@]}" ;;
  K5) timeout 150 python3 -m pytest -q tests/test_trainer_paths.py tests/test_fp8.py -k "fp8 and cuda" > "$OUT/fp8-cuda-tests.log" 2>&1
     tail -3 "$OUT/fp8-cuda-tests.log"  # graphs/compile keep an fp8 run's losses, its export loads; fp8 like bf16
     w=(--work /tmp/lorapipe-bench-0 --keep)  # Qwen-Image's fp8 512 px b1 step (1.03x a bf16 row of another run)
     python3 bench/bench.py run --families qwen-image "${w[@]}" --out "$OUT/bench-qwen-image-K5.json" --budget-s $(( $(left) - 25 )) \
       --only 'qwen-image/train/bf16-512-b1' --only 'qwen-image/train/fp8-512-b1' --only 'qwen-image/profile/fp8-512-b1' --only 'qwen-image/profile/bf16-512-b1' \
       > "$OUT/bench-qwen-image-K5.log" 2>&1 ;;
  K6) timeout 150 python3 -m pytest -q tests/test_trainer_paths.py -k "fp8 and cuda" > "$OUT/fp8-cuda-tests.log" 2>&1
      tail -3 "$OUT/fp8-cuda-tests.log"; exec bash "$0" FL $(( $(left) - 5 )) ;;
  K7) o=(--only '*/train/fp8-*'); bench 0 z-image K7 $(( $(left) / 2 )) "${o[@]}"; bench 0 sdxl K7 $(( $(left) - 25 )) "${o[@]}" ;;
  K8) o=(--only '*/train/fp8-*'); rm -rf /dev/shm/lorapipe-bench/*
      bench 0 qwen-image K8 $(( $(left) / 2 )) "${o[@]}"; bench 0 flux K8 $(( $(left) - 25 )) "${o[@]}" ;;
  K9) o=(--only "*/train/fp8-512-*"); bench 0 qwen-image K9 $(( $(left) / 2 )) "${o[@]}"; bench 0 flux K9 $(( $(left) - 15 )) "${o[@]}" ;;
  F50) timeout $(( $(left) - 10 )) python3 bench/fp8.py --fidelity-only --fidelity-steps 50 --deadline $(( $(left) - 60 )) \
       --out "$OUT/fp8-fidelity50-h200.json" > "$OUT/fp8-fidelity50.log" 2>&1; tail -5 "$OUT/fp8-fidelity50.log" ;;
  FL) for d in bfloat16 float32; do timeout $(( $(left) / 2 )) python3 bench/fp8_load.py --device cuda --layers 4 --single-layers 8 \
       --file-dtype $d --out "$OUT/fp8-load-h200-$d.json" > "$OUT/fp8-load-$d.log" 2>&1; tail -22 "$OUT/fp8-load-$d.log"; done ;;
  A8) python3 bench/memory.py run --families flux --budgets 16 --models /tmp/lorapipe-models --out "$OUT/memory-flux-16gb-fp8-h200.json" \
       --budget-s $(( $(left) - 20 )) > "$OUT/memory-flux-16.log" 2>&1; grep "^\[memory\]" "$OUT/memory-flux-16.log" | cut -c1-300 ;;
  L) pip install -q --no-deps --no-compile --target /tmp/tao .whl/extra/torchao-*.whl
     PYTHONPATH=/tmp/tao:$PYTHONPATH timeout 180 python3 bench/fp8_torchao.py --out "$OUT/fp8-torchao-h200.json" > "$OUT/fp8-torchao.log" 2>&1
     tail -30 "$OUT/fp8-torchao.log"
     PEERS_SIDES=product PEERS_TAG=ab PEERS_PRODUCT=nf4+profile,nf4+cudnn+profile \
       PEERS_BUDGET_S=$(( $(left) - 20 )) bash bench/peers.sh klein 1024 1 15 ;;
  M) PEERS_BUDGET_S=$(( $(left) - 175 )) bash bench/peers.sh kontext 1024 1 15
     timeout $(( $(left) - 5 )) python3 bench/tiling.py --budget-s $(( $(left) - 25 )) --out "$OUT/tiling-h200.json" > "$OUT/tiling.log" 2>&1
     tail -5 "$OUT/tiling.log" ;;
  P) PEERS_TAG=cudnn PEERS_PRODUCT=fp8+cudnn+fitpeer,fp8+cudnn,bf16+cudnn \
       PEERS_BUDGET_S=$(( $(left) - 20 )) bash bench/peers.sh kontext 1024 1 10 ;;
  KA) PEERS_SIDES=product PEERS_TAG=fp8probe PEERS_PEER_ROW=bench/results/peers-klein-1024-b1-g4.json \
       PEERS_PRODUCT=fp8+cudnn,fp8 PEERS_BUDGET_S=$(( $(left) - 20 )) bash bench/peers.sh klein 1024 1 15 ;;
  KB) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py -k mixed > "$OUT/mixed-cuda.log" 2>&1; tail -2 "$OUT/mixed-cuda.log"
      PEERS_TAG=mixed PEERS_PRODUCT=fp8+cudnn+fitpeer,fp8+fitpeer,nf4+cudnn+fitpeer \
        PEERS_BUDGET_S=$(( $(left) - 20 )) bash bench/peers.sh klein 1024 1 15 ;;
  KC) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py -k "mixed or lora_wraps" > "$OUT/mixed-cuda.log" 2>&1
      tail -2 "$OUT/mixed-cuda.log"
      PEERS_TAG=fp8blocks PEERS_PRODUCT=fp8+cudnn+fp8blocks16,fp8+cudnn+fp8blocks14,fp8+cudnn+fp8blocks12 \
        PEERS_BUDGET_S=$(( $(left) - 20 )) bash bench/peers.sh klein 1024 1 15 ;;
  KE) PEERS_TAG=fp8blocks2 PEERS_PRODUCT=fp8+cudnn+fp8blocks18 \
        PEERS_BUDGET_S=$(( $(left) - 15 )) bash bench/peers.sh klein 1024 1 15 ;;
  KF) timeout 60 python3 bench/fp8_tiny_probe.py --out "$OUT/fp8-tiny-probe.json" > "$OUT/fp8-tiny-probe.log" 2>&1; tail -15 "$OUT/fp8-tiny-probe.log"
      timeout 150 python3 bench/sdpa_probe.py --out "$OUT/sdpa-probe.json" > "$OUT/sdpa-probe.log" 2>&1; cat "$OUT/sdpa-probe.log" | cut -c1-300
      PEERS_TAG=fp8blocks2 PEERS_PRODUCT=fp8+cudnn+fp8blocks18,fp8+cudnn+fp8blocks17 \
        PEERS_BUDGET_S=$(( $(left) - 15 )) bash bench/peers.sh klein 1024 1 15 ;;
  KG) timeout 170 python3 bench/cudnn_flux_probe.py --out "$OUT/cudnn-flux-probe.json" > "$OUT/cudnn-flux-probe.log" 2>&1; cut -c1-400 "$OUT/cudnn-flux-probe.log"
      PEERS_TAG=cudnn2 PEERS_PRODUCT=fp8+cudnn+fitpeer,fp8+cudnn PEERS_BUDGET_S=$(( $(left) - 15 )) bash bench/peers.sh kontext 1024 1 10 ;;
  KH) timeout 90 python3 bench/cudnn_flux_probe.py --only kontext-eager-guard,kontext-ckpt-guard --out "$OUT/cudnn-flux-probe-guard.json" \
        > "$OUT/cudnn-flux-probe-guard.log" 2>&1; cut -c1-400 "$OUT/cudnn-flux-probe-guard.log"
      PEERS_TAG=cudnn3 PEERS_PRODUCT=fp8+cudnn+fitpeer,fp8+cudnn PEERS_BUDGET_S=$(( $(left) - 15 )) bash bench/peers.sh kontext 1024 1 10 ;;
  KO) PEERS_SIDES=product PEERS_PEER_ROW=bench/results/peers-klein-1024-b1-fitreserved-fp8.json PEERS_TAG=fitreserved-fp8-why \
        PEERS_PRODUCT=fp8+cudnn+fp8blocks22,fp8+cudnn+fitreserved,fp8+cudnn+fitreserved+nographs PEERS_BUDGET_S=$(( $(left) - 15 )) \
        bash bench/peers.sh klein 1024 1 15 ;;
  KP) PEERS_SIDES=product PEERS_PEER_ROW=bench/results/peers-klein-1024-b1-fitreserved-fp8.json PEERS_TAG=fitreserved-fp8-expandable \
        PEERS_PRODUCT=fp8+cudnn+fitreserved+expandable,fp8+cudnn+fitreserved+expandable+nographs PEERS_BUDGET_S=$(( $(left) - 15 )) \
        bash bench/peers.sh klein 1024 1 15 ;;
  KS) PEERS_TAG=fitreserved-fp8-3 PEERS_PRODUCT=fp8+cudnn+fitreserved,fp8+cudnn+fitreserved+fp8blocks17 \
        PEERS_BUDGET_S=$(( $(left) - 90 )) bash bench/peers.sh klein 1024 1 15
      timeout $(( $(left) - 10 )) python3 -m pytest -q -p no:cacheprovider tests/test_memory.py -k capped_train_stage \
        > "$OUT/allocator-cuda.log" 2>&1; tail -2 "$OUT/allocator-cuda.log" ;;
  KR) timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_memory.py -k capped_train_stage > "$OUT/allocator-cuda.log" 2>&1
      tail -2 "$OUT/allocator-cuda.log"
      timeout 120 python3 bench/cudnn_flux_probe.py --only tiny-32-guard,tiny-32 --out "$OUT/cudnn-flux-probe-tiny32.json" \
        > "$OUT/cudnn-flux-probe-tiny32.log" 2>&1; cut -c1-400 "$OUT/cudnn-flux-probe-tiny32.log"
      PEERS_TAG=fitreserved-fp8-2 PEERS_PRODUCT=fp8+cudnn+fitreserved,fp8+cudnn+fitreserved+fp8blocks17 \
        PEERS_BUDGET_S=$(( $(left) - 15 )) bash bench/peers.sh klein 1024 1 15 ;;
  KQ) PEERS_SIDES=product PEERS_PEER_ROW=bench/results/peers-klein-1024-b1-fitreserved-fp8.json PEERS_TAG=fp8blocks22-expandable \
        PEERS_PRODUCT=fp8+cudnn+fp8blocks22+expandable PEERS_BUDGET_S=$(( $(left) - 15 )) bash bench/peers.sh klein 1024 1 15 ;;
  KM) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py -k "mixed or lora_wraps" > "$OUT/fp8-cuda.log" 2>&1; tail -2 "$OUT/fp8-cuda.log"
      timeout 300 python3 bench/cudnn_flux_probe.py --only tiny-widths-guard,tiny-widths,tiny-tokens-guard,tiny-widths-128-guard,kontext-eager-guard,kontext-ckpt-guard \
        --out "$OUT/cudnn-flux-probe-grads.json" > "$OUT/cudnn-flux-probe-grads.log" 2>&1; cut -c1-500 "$OUT/cudnn-flux-probe-grads.log"
      PEERS_SIDES=product PEERS_PEER_ROW=bench/results/peers-kontext-1024-b1-keepattn.json PEERS_TAG=keepattn-flash \
        PEERS_PRODUCT=fp8+fitpeer+keepattn,fp8+keepattn PEERS_BUDGET_S=$(( $(left) - 15 )) bash bench/peers.sh kontext 1024 1 10 ;;
  KN) PEERS_TAG=fitreserved-fp8 PEERS_PRODUCT=fp8+cudnn+fitreserved,fp8+fitreserved PEERS_BUDGET_S=$(( $(left) - 15 )) \
        bash bench/peers.sh klein 1024 1 15 ;;
  KK) timeout 90 python3 bench/fp8_tiny_probe.py --out "$OUT/fp8-tiny-probe-modes.json" > "$OUT/fp8-tiny-probe-modes.log" 2>&1
      tail -2 "$OUT/fp8-tiny-probe-modes.log" | cut -c1-600
      PEERS_TAG=keepattn PEERS_PRODUCT=fp8+cudnn+fitpeer+keepattn,fp8+cudnn+keepattn PEERS_BUDGET_S=$(( $(left) - 15 )) \
        bash bench/peers.sh kontext 1024 1 10 ;;
  KI) timeout 90 python3 bench/fp8_tiny_probe.py --out "$OUT/fp8-tiny-probe.json" > "$OUT/fp8-tiny-probe.log" 2>&1; tail -3 "$OUT/fp8-tiny-probe.log"
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py -k "mixed or lora_wraps" > "$OUT/fp8-cuda.log" 2>&1; tail -3 "$OUT/fp8-cuda.log"
      PEERS_TAG=fp8blocks3 PEERS_PRODUCT=fp8+cudnn+fp8blocks18,fp8+cudnn+fp8blocks17 \
        PEERS_BUDGET_S=$(( $(left) - 15 )) bash bench/peers.sh klein 1024 1 15 ;;
  P1) PEERS_SIDES=product PEERS_TAG=cudnn1 PEERS_PEER_ROW=bench/results/peers-kontext-1024-b1-run3.json \
       PEERS_PRODUCT=fp8+cudnn+fitpeer,fp8+cudnn,bf16+cudnn PEERS_BUDGET_S=$(( $(left) - 20 )) bash bench/peers.sh kontext 1024 1 10 ;;
  N) PEERS_BUDGET_S=$(( $(left) - 20 )) bash bench/peers.sh kontext 1024 1 10 ;;
  O) bench 0 flux-kontext O $(( $(left) / 2 - 20 )) --keep; bench 0 qwen-image-edit O $(( $(left) - 30 )) --keep ;;
  O2) rm -rf /dev/shm/lorapipe-bench/*; bench 0 flux-kontext O2 $(( $(left) / 2 - 20 )); bench 0 qwen-image-edit O2 $(( $(left) - 30 )) ;;
  P) python3 bench/memory.py run --families qwen-image --budgets 8,auto --set train.profile_steps=2 --keep \
       --models /tmp/lorapipe-models --out "$OUT/memory-qwen-image-8gb-profiled-h200.json" --budget-s $(( $(left) * 11 / 20 )) \
       > "$OUT/memory-qwen.log" 2>&1; grep "^\[memory\]" "$OUT/memory-qwen.log" | cut -c1-300
     python3 bench/memory.py run --families flux --budgets 16,24 --set train.gradient_checkpointing=auto \
       --models /tmp/lorapipe-models --out "$OUT/memory-flux-partialckpt-h200.json" --budget-s $(( $(left) - 30 )) \
       > "$OUT/memory-flux.log" 2>&1; grep "^\[memory\]" "$OUT/memory-flux.log" | cut -c1-300 ;;
  Q) timeout 150 python3 -m pytest -q tests/test_trainer_paths.py tests/test_partial_checkpointing.py \
       -k "nf4_swap or partial_checkpointing_under" > "$OUT/swap-cuda-tests.log" 2>&1; tail -2 "$OUT/swap-cuda-tests.log"
     python3 bench/memory.py run --families qwen-image --budgets 8,16,auto --keep --models /tmp/lorapipe-models \
       --out "$OUT/memory-qwen-image-8gb-slots-h200.json" --budget-s $(( $(left) * 7 / 10 )) \
       > "$OUT/memory-qwen.log" 2>&1; grep "^\[memory\]" "$OUT/memory-qwen.log" | cut -c1-300
     python3 bench/memory.py run --families flux --budgets 16,24 --set train.gradient_checkpointing=auto \
       --models /tmp/lorapipe-models --out "$OUT/memory-flux-partialckpt-h200.json" --budget-s $(( $(left) - 30 )) \
       > "$OUT/memory-flux.log" 2>&1; grep "^\[memory\]" "$OUT/memory-flux.log" | cut -c1-300 ;;
  R) python3 bench/memory.py run --families flux --budgets 6,12,auto --models /tmp/lorapipe-models \
       --out "$OUT/memory-flux-6gb-slots-h200.json" --budget-s $(( $(left) * 11 / 20 )) \
       > "$OUT/memory-flux.log" 2>&1; grep "^\[memory\]" "$OUT/memory-flux.log" | cut -c1-300
     python3 bench/memory.py run --families z-image --budgets 4,8,auto --models /tmp/lorapipe-models \
       --out "$OUT/memory-zimage-4gb-slots-h200.json" --budget-s $(( $(left) - 30 )) \
       > "$OUT/memory-zimage.log" 2>&1; grep "^\[memory\]" "$OUT/memory-zimage.log" | cut -c1-300 ;;
  S) python3 bench/memory.py run --res 512 --families qwen-image,flux --budgets 8,6,auto --models /tmp/lorapipe-models \
       --out "$OUT/memory-qwen-flux-512-h200.json" --budget-s $(( $(left) * 11 / 20 )) \
       > "$OUT/memory-512a.log" 2>&1; grep "^\[memory\]" "$OUT/memory-512a.log" | cut -c1-300
     python3 bench/memory.py run --res 512 --families z-image,sdxl --budgets 4,auto --models /tmp/lorapipe-models \
       --out "$OUT/memory-zimage-sdxl-512-h200.json" --budget-s $(( $(left) - 30 )) \
       > "$OUT/memory-512b.log" 2>&1; grep "^\[memory\]" "$OUT/memory-512b.log" | cut -c1-300 ;;
  U) python3 bench/memory.py run --families qwen-image --budgets auto --models /tmp/lorapipe-models \
       --out "$OUT/memory-qwen-image-auto-h200.json" --budget-s $(( $(left) * 9 / 20 )) \
       > "$OUT/memory-qwen.log" 2>&1; grep "^\[memory\]" "$OUT/memory-qwen.log" | cut -c1-300
     rm -rf /tmp/lorapipe-models/qwen-image /tmp/lorapipe-memory; df -h /tmp | tail -1
     python3 bench/memory.py run --families z-image --budgets 4,8,auto --models /tmp/lorapipe-models \
       --out "$OUT/memory-zimage-4gb-slots-h200.json" --budget-s $(( $(left) - 25 )) \
       > "$OUT/memory-zimage.log" 2>&1; grep "^\[memory\]" "$OUT/memory-zimage.log" | cut -c1-300 ;;
  V) python3 bench/memory.py run --families flux --budgets 6,12,auto --models /tmp/lorapipe-models \
       --out "$OUT/memory-flux-6gb-slots-h200.json" --budget-s $(( $(left) - 25 )) \
       > "$OUT/memory-flux.log" 2>&1; grep "^\[memory\]" "$OUT/memory-flux.log" | cut -c1-300
     [ "$(left)" -gt 90 ] && timeout $(( $(left) - 15 )) python3 bench/swap_probe.py --steps 20 --only resident_compiled \
       --only swap_compiled --out "$OUT/swap-probe-qwen-compiled-20-h200.json" > "$OUT/swap-probe.log" 2>&1; tail -3 "$OUT/swap-probe.log" ;;
  W) python3 bench/memory.py run --families flux --budgets 6,8 --models /tmp/lorapipe-models --keep \
       --out "$OUT/memory-flux-6-8gb-h200.json" --budget-s $(( $(left) * 13 / 20 )) \
       > "$OUT/memory-flux.log" 2>&1; grep "^\[memory\]" "$OUT/memory-flux.log" | cut -c1-300
     python3 bench/memory.py run --families flux --budgets 16,24 --set train.gradient_checkpointing=auto \
       --models /tmp/lorapipe-models --out "$OUT/memory-flux-partialckpt-h200.json" --budget-s $(( $(left) - 20 )) \
       > "$OUT/memory-flux-x.log" 2>&1; grep "^\[memory\]" "$OUT/memory-flux-x.log" | cut -c1-300 ;;
  X2) python3 bench/memory.py run --families flux --budgets 16,24 --set train.gradient_checkpointing=auto \
       --models /tmp/lorapipe-models --out "$OUT/memory-flux-partialckpt-units-h200.json" --budget-s $(( $(left) - 20 )) \
       > "$OUT/memory-flux.log" 2>&1; grep "^\[memory\]" "$OUT/memory-flux.log" | cut -c1-300 ;;
  X) python3 bench/memory.py run --families flux --budgets 16,24 --set train.gradient_checkpointing=auto \
       --models /tmp/lorapipe-models --out "$OUT/memory-flux-partialckpt-h200.json" --budget-s $(( $(left) - 20 )) \
       > "$OUT/memory-flux.log" 2>&1; grep "^\[memory\]" "$OUT/memory-flux.log" | cut -c1-300 ;;
  Y) m=(--models /tmp/lorapipe-models)
     timeout 150 python3 -m pytest -q tests/test_trainer_paths.py -k "nf4_swap and cuda" > "$OUT/swap-cuda-tests.log" 2>&1
     tail -2 "$OUT/swap-cuda-tests.log"  # "auto" with and without room, "on": the losses as unswapped runs'
     python3 bench/memory.py run --res 512 --families flux --budgets 6 "${m[@]}" --keep --out "$OUT/memory-flux-512-6gb-room-h200.json" \
       --budget-s $(( $(left) / 2 )) > "$OUT/memory-flux-512.log" 2>&1; grep "^\[memory\]" "$OUT/memory-flux-512.log" | cut -c1-300
     python3 bench/memory.py run --families flux --budgets 6,8 "${m[@]}" --out "$OUT/memory-flux-6-8gb-room-h200.json" \
       --budget-s $(( $(left) - 20 )) > "$OUT/memory-flux.log" 2>&1; grep "^\[memory\]" "$OUT/memory-flux.log" | cut -c1-300 ;;
  Z) m=(--models /tmp/lorapipe-models)
     python3 bench/memory.py run --res 512 --families qwen-image --budgets 8 "${m[@]}" --keep --out "$OUT/memory-qwen-image-512-8gb-room-h200.json" \
       --budget-s $(( $(left) * 45 / 100 )) > "$OUT/memory-qwen-512.log" 2>&1; grep "^\[memory\]" "$OUT/memory-qwen-512.log" | cut -c1-300
     python3 bench/memory.py run --families qwen-image --budgets 8 "${m[@]}" --keep --out "$OUT/memory-qwen-image-8gb-room-h200.json" \
       --budget-s $(( $(left) * 6 / 10 )) > "$OUT/memory-qwen.log" 2>&1; grep "^\[memory\]" "$OUT/memory-qwen.log" | cut -c1-300
     python3 bench/memory.py run --families qwen-image --budgets 8 --set train.cuda_graphs=off "${m[@]}" --out "$OUT/memory-qwen-image-8gb-eager-h200.json" \
       --budget-s $(( $(left) - 20 )) > "$OUT/memory-qwen-e.log" 2>&1; grep "^\[memory\]" "$OUT/memory-qwen-e.log" | cut -c1-300 ;;
  Z2) m=(--models /tmp/lorapipe-models)
     python3 bench/memory.py run --families qwen-image --budgets 8 "${m[@]}" --keep --out "$OUT/memory-qwen-image-8gb-room-h200.json" \
       --budget-s $(( $(left) * 62 / 100 )) > "$OUT/memory-qwen.log" 2>&1; grep "^\[memory\]" "$OUT/memory-qwen.log" | cut -c1-300
     python3 bench/memory.py run --res 512 --families qwen-image --budgets 8 "${m[@]}" --out "$OUT/memory-qwen-image-512-8gb-room-h200.json" \
       --budget-s $(( $(left) - 15 )) > "$OUT/memory-qwen-512.log" 2>&1; grep "^\[memory\]" "$OUT/memory-qwen-512.log" | cut -c1-300 ;;
  Y2) python3 bench/memory.py run --res 512 --families flux --budgets 6 --models /tmp/lorapipe-models --out "$OUT/memory-flux-512-6gb-room-h200.json" \
       --budget-s $(( $(left) * 48 / 100 )) > "$OUT/memory-flux-512.log" 2>&1; grep "^\[memory\]" "$OUT/memory-flux-512.log" | cut -c1-300
     python3 bench/memory.py run --res 512 --families z-image --budgets 4,auto --models /tmp/lorapipe-models \
       --out "$OUT/memory-zimage-512-room-h200.json" --budget-s $(( $(left) - 15 )) > "$OUT/memory-z.log" 2>&1; grep "^\[memory\]" "$OUT/memory-z.log" | cut -c1-300 ;;
  Y3) m=(--res 512 --models /tmp/lorapipe-models)
     python3 bench/memory.py run "${m[@]}" --families flux --budgets 6 --out "$OUT/memory-flux-512-6gb-room2-h200.json" \
       --budget-s $(( $(left) * 48 / 100 )) > "$OUT/memory-flux-512.log" 2>&1; grep "^\[memory\]" "$OUT/memory-flux-512.log" | cut -c1-300
     python3 bench/memory.py run "${m[@]}" --families z-image --budgets 4,auto \
       --out "$OUT/memory-zimage-512-room2-h200.json" --budget-s $(( $(left) - 15 )) > "$OUT/memory-z.log" 2>&1; grep "^\[memory\]" "$OUT/memory-z.log" | cut -c1-300 ;;
  SP2) python3 bench/memory.py run --res 512 --models /tmp/lorapipe-models --families flux --budgets 6 --set train.block_swap_layout=spread \
       --out "$OUT/memory-flux-512-6gb-spread-h200.json" --budget-s $(( $(left) * 48 / 100 )) > "$OUT/memory-flux-512-s.log" 2>&1
     grep "^\[memory\]" "$OUT/memory-flux-512-s.log" | cut -c1-300
     python3 bench/memory.py run --res 512 --families sdxl --budgets auto,4,8 --models /tmp/lorapipe-models \
       --out "$OUT/memory-sdxl-512-h200.json" --budget-s $(( $(left) - 15 )) > "$OUT/memory-sdxl.log" 2>&1; grep "^\[memory\]" "$OUT/memory-sdxl.log" | cut -c1-300 ;;
  SP) m=(--res 512 --models /tmp/lorapipe-models)
     python3 bench/memory.py run "${m[@]}" --families qwen-image --budgets 8 --keep --set train.block_swap_layout=spread \
       --out "$OUT/memory-qwen-image-512-8gb-spread-h200.json" --budget-s $(( $(left) * 55 / 100 )) > "$OUT/memory-qwen-512-s.log" 2>&1
     grep "^\[memory\]" "$OUT/memory-qwen-512-s.log" | cut -c1-300
     python3 bench/memory.py run "${m[@]}" --families qwen-image --budgets 8 --out "$OUT/memory-qwen-image-512-8gb-room2-h200.json" \
       --budget-s $(( $(left) - 15 )) > "$OUT/memory-qwen-512.log" 2>&1; grep "^\[memory\]" "$OUT/memory-qwen-512.log" | cut -c1-300 ;;
  S2) python3 bench/memory.py run --res 512 --families z-image --budgets 4 --models /tmp/lorapipe-models --keep \
       --out "$OUT/memory-zimage-512-4gb-room-h200.json" --budget-s $(( $(left) * 6 / 10 )) > "$OUT/memory-z-g.log" 2>&1; grep "^\[memory\]" "$OUT/memory-z-g.log" | cut -c1-300
     python3 bench/memory.py run --res 512 --families z-image --budgets auto --models /tmp/lorapipe-models \
       --out "$OUT/memory-zimage-512-auto-h200.json" --budget-s $(( $(left) - 20 )) > "$OUT/memory-z.log" 2>&1; grep "^\[memory\]" "$OUT/memory-z.log" | cut -c1-300 ;;
  S3) python3 bench/memory.py run --res 512 --families sdxl --budgets auto,4,8 --models /tmp/lorapipe-models \
       --out "$OUT/memory-sdxl-512-h200.json" --budget-s $(( $(left) - 20 )) > "$OUT/memory-sdxl.log" 2>&1; grep "^\[memory\]" "$OUT/memory-sdxl.log" | cut -c1-300 ;;
  T) timeout 240 python3 bench/tiling.py --budget-s 140 --out "$OUT/tiling-h200.json" > "$OUT/tiling.log" 2>&1
     grep -v "kept in float32" "$OUT/tiling.log" | tail -20 ;;
esac
grep -h "^\[bench\]" "$OUT"/bench-*.log 2>/dev/null | cut -c1-300
ls -la "$OUT"
