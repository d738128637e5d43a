# Release check of the session's last code: every gpu-marked test, and the 50 iterations.
T0=$(date +%s)
C=$(cat COMMIT)
R=$OUT/r; mkdir -p $R
stamp(){ echo "[$(( $(date +%s)-T0 ))s] $*"; }
stamp equal50
timeout 120 python3 tools/check_plans_equal.py --gpu 0 --math deterministic --workspace_limit 8388608 --iters 50 --plans stock,shared,offload,arena --algorithms > $R/${C}_gpu_check_plans_equal_50.txt 2>&1; echo rc=$? >> $R/${C}_gpu_check_plans_equal_50.txt; tail -12 $R/${C}_gpu_check_plans_equal_50.txt
stamp tests
timeout 330 python3 -m pytest -q -p no:cacheprovider -rfExX --tb=short -m gpu tests > $R/${C}_pytest_gpu.log 2>&1; echo rc=$? >> $R/${C}_pytest_gpu.log; tail -8 $R/${C}_pytest_gpu.log
stamp done
tar -czf $OUT/s23d.tgz -C $R .
