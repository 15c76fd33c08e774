set -u
run() { # gpu scheme drop
  local tag="${2}_${3:-none}"; tag="${tag//,/+}"
  CUDA_VISIBLE_DEVICES=$1 python3 benchmarks/probe_decode_batch.py --batch 1 --warm 16 --top 12 --scheme $2 ${3:+--drop $3} --out $OUT/r/probe_bs1_$tag.json > $OUT/r/probe_bs1_$tag.log 2>&1
  echo "$tag: $(grep 'graph replay' $OUT/r/probe_bs1_$tag.log)"
}
( for d in "" norm rope attn norm,rope,attn; do run 0 fp8-wo "$d"; done ) > $OUT/r/g0.txt 2>&1 &
P=$!
( for d in "" norm,rope,attn norm; do run 1 w4a16-g128 "$d"; done ) > $OUT/r/g1.txt 2>&1
wait $P
cat $OUT/r/g0.txt $OUT/r/g1.txt
