# shared against arena, free against shared, all four bench nets (interleaved rounds).
T0=$(date +%s)
B=$PWD/.gpu_carry/bench
C=$(cat COMMIT)
R=$OUT/r; mkdir -p $R
stamp(){ echo "[$(( $(date +%s)-T0 ))s] $*"; }
sed -e 's/dim: 64 dim: 3/dim: 1 dim: 3/; s/shape { dim: 64 }/shape { dim: 1 }/' $B/googlenet_b64.prototxt > /tmp/googlenet_b1.prototxt
tp(){ n=$1; t=$2; lim=$3; shift 3; stamp "time $n $t"; timeout $lim python3 tools/time_plans.py --net $n --gpu 0 --offload free "$@" > $R/${C}_h200_time_plans_$t.txt 2>&1; tail -5 $R/${C}_h200_time_plans_$t.txt; }
tp $B/googlenet_b64.prototxt googlenet_b64 100 --plans arena,shared,offload,arena@SAME=1 --rounds 24 --iters 8 --warmup 15
tp $B/googlenet_b64.prototxt googlenet_b64_sharedfirst 100 --plans shared,offload,arena,shared@SAME=1 --rounds 24 --iters 8 --warmup 15
tp /tmp/googlenet_b1.prototxt googlenet_b1 60 --plans arena,shared,arena@SAME=1 --rounds 16 --iters 8 --warmup 10
tp $B/alexnet_b128.prototxt alexnet_b128 90 --plans arena,shared,offload,arena@SAME=1 --rounds 16 --iters 8 --warmup 15
tp $B/resnet50_b64.prototxt resnet50_b64 140 --plans arena,shared,offload,arena@SAME=1 --rounds 10 --iters 6 --warmup 12
tp $B/vgg16_b64.prototxt vgg16_b64 140 --plans arena,shared,offload,arena@SAME=1 --rounds 8 --iters 6 --warmup 12
stamp done
tar -czf $OUT/s23c.tgz -C $R .
