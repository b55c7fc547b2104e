R=$OUT; export OUT=/tmp/o; rm -rf /tmp/o; mkdir -p $OUT
nvidia-smi -L | cut -c1-40
W=/tmp/wreg benches/regret calibrate && W=/tmp/wreg CONFIGS=1gpu benches/regret runs
grep -h "element-wise\|layout cop" $OUT/calibrate.log
source benches/lib/env.sh; gpu_env; BIN=/tmp/wreg/mold; IDX=$(ls /tmp/wreg/f/*.index.json|head -1); M=/tmp/wreg/box.yaml
$BIN plan --model flux-dev --machine $M --tp off --sp off --devices cuda:0 --dtype transformer=fp8 -o /tmp/wreg/fp8.yaml --force > $OUT/plan-fp8.log 2>&1
for p in fp8 1gpu; do MOLD_PROFILE=events timeout 120 $BIN exec /tmp/wreg/$p.yaml --machine $M --weights $IDX --steps 6 --seed 1 > $OUT/prof-$p.log 2>&1; echo "prof $p rc=$? $(grep 'step time' $OUT/prof-$p.log)"; done
tar czf $R/all.tgz -C $OUT .
