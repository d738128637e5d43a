timeout 100 python3 tools/relayout_ref_probe.py 2>&1 | grep -v "^I2026\|^W2026" | grep -v "^ \|^layer\|^}\|^name\|^input\|^state" | tail -30
