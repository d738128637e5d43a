C=$(cat COMMIT); R=$OUT/r; mkdir -p $R
for k in 1 2; do timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_memory_apply.py -k relayout_frees 2>&1 | tail -3; done
timeout 100 python3 tools/relayout_ref_probe.py 2>&1 | grep -v "^I2026\|^W2026" | tail -30
