# Review commits: every gpu-marked test, and the 50-iteration equality check.
C=$(cat COMMIT); R=$OUT/r; mkdir -p $R
timeout 120 python3 tools/check_plans_equal.py --gpu 0 --math deterministic --workspace_limit 8388608 --iters 50 --plans stock,shared,offload,arena --algorithms 2>&1 | grep -v "^W2026" > $R/${C}_gpu_check_plans_equal_50.txt; tail -16 $R/${C}_gpu_check_plans_equal_50.txt | grep -c "bit-identical"
timeout 330 python3 -m pytest -q -p no:cacheprovider -rfExX --tb=short -m gpu tests > $R/${C}_pytest_gpu.log 2>&1; echo rc=$? >> $R/${C}_pytest_gpu.log; tail -6 $R/${C}_pytest_gpu.log
tar -czf $OUT/s23f.tgz -C $R .
