C=$(cat COMMIT); R=$OUT/r; mkdir -p $R
T0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_memory_apply.py 2>&1 | tail -4
echo "[$(( $(date +%s)-T0 ))s]"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_memory_apply.py tests/test_memory_command.py tests/test_masks.py 2>&1 | tail -4
echo "[$(( $(date +%s)-T0 ))s]"
