T0=$(date +%s)
B=.gpu_carry/bench
C=$(cat COMMIT)
R=$OUT/r; mkdir -p $R
stamp(){ echo "[$(( $(date +%s)-T0 ))s] $*"; }
sed -e 's/dim: 64 dim: 3/dim: 1 dim: 3/; s/shape { dim: 64 }/shape { dim: 1 }/' $B/googlenet_b64.prototxt > /tmp/googlenet_b1.prototxt
tp(){ n=$1; t=$2; shift; shift; stamp "time $n $t"; timeout 150 python3 tools/time_plans.py --net $n --gpu 0 --offload free "$@" > $R/${C}_h200_time_plans_$t.txt 2>&1; tail -9 $R/${C}_h200_time_plans_$t.txt; }
tp /tmp/googlenet_b1.prototxt googlenet_b1_variants --plans arena,shared,shared@CAFFEPLUS_UPDATE_IN_BACKWARD=0,shared@CAFFEPLUS_MASKS=0,shared@CAFFEPLUS_CUBLAS_IN_ARENA=0,arena@SAME=1 --rounds 10 --iters 10 --warmup 10
stamp profile
timeout 150 python3 tools/profile_step.py --net /tmp/googlenet_b1.prototxt --gpu 0 --plan arena --against shared --iters 20 --warmup 10 --top 45 > $R/${C}_profile_googlenet_b1_arena_shared.txt 2>&1
sed -n '/own host time per iteration/,$p' $R/${C}_profile_googlenet_b1_arena_shared.txt | head -100
tp $B/googlenet_b64.prototxt googlenet_b64 --plans arena,shared,offload,arena@SAME=1 --rounds 14 --iters 10 --warmup 15
stamp done
tar -czf $OUT/s23a.tgz -C $R .
