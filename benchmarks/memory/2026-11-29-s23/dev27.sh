# Host time old (74a443a) against new; shared against arena at b1 and b64; the gpu suite.
T0=$(date +%s)
B=$PWD/.gpu_carry/bench
C=$(cat COMMIT)
R=$OUT/r; mkdir -p $R
NEW=$PWD; OLD=$(cd ../src_old && pwd)
stamp(){ echo "[$(( $(date +%s)-T0 ))s] $*"; }
sed -e 's/dim: 64 dim: 3/dim: 1 dim: 3/; s/shape { dim: 64 }/shape { dim: 1 }/' $B/googlenet_b64.prototxt > /tmp/googlenet_b1.prototxt
for k in 1 2; do for tree in OLD NEW; do
  d=${!tree}; stamp "host $tree $k"
  (cd $d && PYTHONPATH=$d:/tmp/site timeout 100 python3 tools/time_plans.py --net /tmp/googlenet_b1.prototxt --gpu 0 --plans arena,shared --rounds 6 --iters 10 --warmup 10 2>&1 | tail -2) | tee -a $R/${C}_host_old_new_b1.txt
done; done
tp(){ n=$1; t=$2; shift; shift; stamp "time $n $t"; timeout 200 python3 tools/time_plans.py --net $n --gpu 0 --offload free "$@" > $R/${C}_h200_time_plans_$t.txt 2>&1; tail -5 $R/${C}_h200_time_plans_$t.txt; }
tp /tmp/googlenet_b1.prototxt googlenet_b1 --plans arena,shared,offload,arena@SAME=1 --rounds 16 --iters 8 --warmup 15
tp $B/googlenet_b64.prototxt googlenet_b64 --plans arena,shared,offload,arena@SAME=1 --rounds 24 --iters 8 --warmup 15
stamp tests
timeout 280 python3 -m pytest -q -p no:cacheprovider -rfExX --tb=short -m gpu tests > $R/${C}_pytest_gpu.log 2>&1; echo rc=$? >> $R/${C}_pytest_gpu.log; tail -6 $R/${C}_pytest_gpu.log
stamp done
tar -czf $OUT/s23b.tgz -C $R .
