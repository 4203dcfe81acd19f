#!/usr/bin/env bash
# One side-by-side call on the H200 machine (bench/peers.md), results and logs in $OUT:
#   bash bench/peers.sh klein|kontext|ideogram [RES=1024] [BATCH=1] [STEPS=20]
#   bash bench/peers.sh wan14b [RES=640] [BATCH=1] [STEPS=10] [FRAMES=33]   (musubi-tuner, bench/peers_video.py)
# PEERS_SIDES=product runs the product only (PEERS_PEER_ROW=<an earlier peers JSON> shows the script's row from it); PEERS_PRODUCT=nf4,nf4+profile,... its train variants
# (bench/peers.py VARIANT_FLAGS); PEERS_TAG=x names the files peers-<which>-<res>-b<batch>-x.*.
# after `pip install ... --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD`, with .whl and
# .carry-peers carried. Builds the full-size random-weight pipeline in /dev/shm unless a warm machine
# still has it (one family there at a time), then runs bench/peers.py within ~560 s of this script's start.
set -u
which=$1; res=${2:-}; batch=${3:-1}; steps=${4:-}; frames=${5:-33}
runner=bench/peers.py; build_flags=""; ready=model_index.json
case $which in
  klein) fam=flux2-klein; prec=nf4,nf4+fitpeer,nf4+cudnn+fitpeer ;;
  # Kontext: the script trains a bf16 base (the product's bf16 row too); its backward died in cuDNN SDPA.
  # fp8 first: FLUX.1's fp8 step was 0.86-0.93x bf16's at every shape, and under the script's peak
  # (fitpeer) it can checkpoint fewer blocks, the product's best chance at 2x
  kontext) fam=flux-kontext; prec=fp8+fitpeer,fp8,bf16,nf4; peer_flags=--peer-no-cudnn-sdpa ;;
  # Ideogram 4: the script pads every caption to --max_sequence_length and has nf4 (bitsandbytes) like klein
  ideogram) fam=ideogram4; prec=nf4,nf4+fitpeer,fp8+fitpeer ;;
  # Wan 2.2 T2V-A14B, high-noise expert, beside musubi-tuner (bf16 base there): 480p clips. The build skips the
  # low-noise expert (neither side loads it: bench/staged.py leaves its config), the converted transformer sits
  # beside the model folder in /dev/shm
  wan14b) fam=wan2.2-14b; prec=bf16; runner=bench/peers_video.py; res=${res:-640}; steps=${steps:-10}
          build_flags="--components text_encoder,vae,transformer"; ready=transformer/config.json ;;  # built last
  *) echo "usage: bash bench/peers.sh klein|kontext|ideogram|wan14b [res] [batch] [steps] [frames: wan14b]"; exit 2 ;;
esac
res=${res:-1024}; steps=${steps:-20}
[ "$runner" = bench/peers_video.py ] && peer_flags="--frames $frames --dit-dir /dev/shm/m/$fam.musubi"

start=$(date +%s)
m=/dev/shm/m/$fam
for other in /dev/shm/m/*; do [ -e "$other" ] && [ "$other" != "$m" ] && [ "$other" != "$m.musubi" ] && rm -rf "$other"; done
if [ ! -e "$m/$ready" ]; then  # a staged build writes model_index.json first, each module when it is whole
  python3 bench/bench.py build --family $fam --folder $m --counts $OUT/build-$fam.json $build_flags > $OUT/build-$fam.log 2>&1 \
    || { tail -30 $OUT/build-$fam.log; exit 1; }
  echo "built $fam in $(( $(date +%s) - start )) s"
fi
left=$(( ${PEERS_BUDGET_S:-560} - ($(date +%s) - start) ))
tag=$which-$res-b$batch${PEERS_TAG:+-$PEERS_TAG}
python3 $runner run --family $fam --model $m --data /tmp/peers-data/$which --res $res --batch $batch \
  --steps $steps ${peer_flags:-} --product-precisions ${PEERS_PRODUCT:-$prec} --sides ${PEERS_SIDES:-peer,product} ${PEERS_PEER_ROW:+--peer-row $PEERS_PEER_ROW} --budget-s $left --peer-timeout-s $(( left * 45 / 100 )) \
  --out $OUT/peers-$tag.json > $OUT/peers-$tag.log 2>&1
echo "rc $? after $(( $(date +%s) - start )) s"
grep -h "^\[peers\]" $OUT/peers-$tag.log | cut -c1-400
cp /tmp/lorapipe-peers/peer-$fam-$res-b$batch.log $OUT/ 2>/dev/null
tail -c 1500 $OUT/peers-$tag.log
