#!/usr/bin/env bash
# Compile caches of one GPU machine, packed for the next fresh one: Triton's (compiled kernels and, with
# TRITON_CACHE_AUTOTUNING=1, autotuning results: the FLA prefill kernels' autotuning is most of an engine's
# "profiling/warmup run", about 80 s at 9B shapes), vLLM's torch.compile cache (about 45 s per engine) and the
# tiny test models (VLLM_BOLE_CACHE). A machine with the same GPU, CUDA, torch, Triton and vLLM finds its kernels
# there instead of compiling and autotuning them again; anything that changed is simply compiled anew.
#   bash scripts/gpu-cache.sh pack DIR     DIR/gpu-cache.tgz.00, .01, ... (parts of at most 15 MiB, GPU_CACHE_PART;
#                                          4 at most: what does not fit falls back to less, down to the autotuning)
#   bash scripts/gpu-cache.sh unpack DIR   restore those parts into $HOME (and the test models' cache)
set -euo pipefail
cmd=${1:?usage: scripts/gpu-cache.sh pack|unpack DIR}
dir=${2:?usage: scripts/gpu-cache.sh pack|unpack DIR}
PART=${GPU_CACHE_PART:-15m}
MAX_PARTS=4
cd "$HOME"
paths=()
for p in .triton/cache .cache/vllm .cache/vllm-bole; do [ -d "$p" ] && paths+=("$p"); done
case $cmd in
  pack)
    mkdir -p "$dir"
    rm -f "$dir"/gpu-cache.tgz.*
    [ ${#paths[@]} -gt 0 ] || { echo "gpu-cache: nothing to pack under $HOME"; exit 0; }
    IR=(--exclude='*.ttir' --exclude='*.ttgir' --exclude='*.llir' --exclude='*.ptx' --exclude='*.source')
    pack() { rm -f "$dir"/gpu-cache.tgz.*; tar czf - "$@" | split -b "$PART" -d - "$dir/gpu-cache.tgz."
             n=$(ls "$dir"/gpu-cache.tgz.* | wc -l); [ "$n" -le "$MAX_PARTS" ]; }
    # Triton's caches: its own, and those vLLM points it to inside each torch.compile cache (TRITON_CACHE_DIR is
    # set there for the whole process, so the FLA kernels' autotuning lands in them too).
    triton=(); [ -d .triton/cache ] && triton+=(.triton/cache)
    [ -d .cache/vllm ] && while IFS= read -r d; do triton+=("$d"); done \
      < <(find .cache/vllm -type d -name triton_cache -prune)
    autotune=$(mktemp); [ ${#triton[@]} -gt 0 ] && find "${triton[@]}" -name '*.autotune.json' > "$autotune"
    # Everything; else without intermediate IR (loading a cached kernel needs its binary, metadata and launcher:
    # Triton's cache group lists the files and skips a missing one); else Triton's caches alone; else only the
    # autotuning results (the longest part of a start-up: each kernel then compiles once, at its tuned config).
    if pack "${paths[@]}"; then what="${paths[*]}"
    elif pack "${IR[@]}" "${paths[@]}"; then what="${paths[*]} without IR"
    elif [ ${#triton[@]} -gt 0 ] && pack "${IR[@]}" "${triton[@]}"; then what="${#triton[@]} Triton caches"
    elif [ -s "$autotune" ] && pack --files-from="$autotune"; then what="$(wc -l < "$autotune") autotuning results"
    else
      echo "gpu-cache: more than $MAX_PARTS parts of $PART even for the autotuning results alone; keeping none" >&2
      rm -f "$dir"/gpu-cache.tgz.* "$autotune"
      exit 1
    fi
    rm -f "$autotune"
    echo "gpu-cache: $(du -ch "$dir"/gpu-cache.tgz.* | tail -1 | cut -f1) in $n parts: $what" ;;
  unpack)
    ls "$dir"/gpu-cache.tgz.* > /dev/null 2>&1 || { echo "gpu-cache: no parts in $dir"; exit 0; }
    cat "$dir"/gpu-cache.tgz.* | tar xzf - -C "$HOME"
    echo "gpu-cache: restored $(du -sh .triton/cache 2>/dev/null | cut -f1) of Triton cache," \
         "$(du -sh .cache/vllm 2>/dev/null | cut -f1) of vLLM cache" ;;
  *)
    echo "usage: scripts/gpu-cache.sh pack|unpack DIR" >&2; exit 2 ;;
esac
