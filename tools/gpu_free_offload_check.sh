mkdir -p $OUT/m; for n in resnet50_b64 googlenet_b64 vgg16_b64 alexnet_b128; do python3 -m caffeplus memory -model .gpu_carry/bench/$n.prototxt -gpu 0 --plans shared,offload --offload free --iterations 8 --json > $OUT/m/free_$n.json 2> $OUT/m/free_$n.log; echo "== $n rc=$?"; python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))[\"plans\"]
for k,v in d.items(): print(k, round(v[\"peak_bytes\"]/2**20), \"MiB\", v.get(\"iter_ms\"), \"ms; offloaded\", len(v.get(\"offloaded\") or []), \"bw\", v.get(\"offload_bandwidth\"), v.get(\"measure_error\",\"\")[-300:])
" $OUT/m/free_$n.json; done
