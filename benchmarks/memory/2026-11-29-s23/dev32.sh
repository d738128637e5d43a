C=$(cat COMMIT); R=$OUT/r; mkdir -p $R
timeout 330 python3 -m pytest -q -p no:cacheprovider -rfExX --tb=short -m gpu tests > $R/${C}_pytest_gpu.log 2>&1; echo rc=$? >> $R/${C}_pytest_gpu.log; tail -8 $R/${C}_pytest_gpu.log
tar -czf $OUT/s23e.tgz -C $R .
