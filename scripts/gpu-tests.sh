#!/usr/bin/env bash
# The tests that mean more on a GPU: Triton kernels against their references, and tiny engines with Bole's CUDA
# graphs against vLLM without speculation, several engines side by side.
#   bash scripts/gpu-tests.sh LOG_DIR [GROUP ...]      groups: kernels lossless calibration lossless-all
#                                                      serving sampling prefix-caching mixed multimodal moe
#                                                      (default: kernels lossless serving)
# GROUP_TIMEOUT=SECONDS limits each group. Each group writes LOG_DIR/<group>.log, one line per test as it ends
# (pytest -v: a run cut short still says which passed), and a one-line summary to stdout. Engine tests start two to four engines one after another (100-170 s
# each on an H200), and a file's tests share one worker (its reference runs once), so a group takes minutes.
#   kernels       Triton kernels and graph helpers against the torch references (no engine)
#   lossless      the core lossless engine tests (deep global and per-request trees, the MTP drafter, a draft
#                 vocabulary served from a table under the default budget rule, a learned one ("auto", sync and
#                 async), async scheduling, a request at max_model_len, chain steps under async scheduling), with
#                 graph stand-ins forced wherever a larger graph fits (VLLM_BOLE_CAPTURE_AFTER=1000000:
#                 tests/e2e_support.assert_graphs_used then checks one was used); a test per worker
#                 (LOSSLESS_WORKERS, 9), each starting two engines (about 300 s a test on an H200 or H100; seven of
#                 them side by side with two more engine tests passed in 368 s on an H100). The rule "throughput"
#                 is in charge in the draft-vocabulary test (a made-up table with curves for the tiny model).
#   calibration   tests/test_calibration.py::test_calibrate_then_serve_auto_budget alone: a calibration, then
#                 seven engines in a row (the budget rules, and the planted drafter served from the table it
#                 calibrated, synchronously and asynchronously); over 15 minutes
#   lossless-all  every test of tests/test_e2e_lossless.py and tests/test_async_scheduling.py, the same way (25
#                 items: more than 15 minutes with 3 workers)
#   serving       logits processors, preemption, structured outputs, the warm-up (no kernel compiled after it:
#                 vLLM's JIT monitor in "error" mode); the sampling tests are a group of their own (together
#                 they ran past 440 s on an H100)
#   sampling      sampled trees against the reference distribution
#   prefix-caching  multi-turn conversations with prefix caching (sync and async), preemption and aborts of shared
#                 blocks, a test per worker (5), Bole's CUDA graphs replayed (tests/e2e_support.assert_graphs_used);
#                 the MoE tests need vLLM's MoE kernels (make-bundle --moe), else they skip. Five side by
#                 side: about 530 s on an H100
#   mixed         steps that carry prompt chunks beside trees (drafted before the host walk, on the device):
#                 async trees against drafting after the walk, the chunked MTP case, its fallback when drafting
#                 before the walk fails, and turns prefilled beside trees with prefix caching; a test per worker
#                 (on an H100 the chunked case ended within 420 s, the async and prefix-caching ones did not)
#   multimodal    image prompts (a tiny Qwen3.5 with a vision tower): planted and MTP trees lossless, and the MTP
#                 drafter's rows at the target's M-RoPE positions (rows written outside the level graphs)
#   moe           the tiny MoE models (Qwen3.5 MoE, Qwen3-Next): planted and MTP trees lossless, side by side (a
#                 test per model, its planted and MTP engines side by side after the reference); needs vLLM's MoE
#                 kernels (make-bundle --moe), else they skip. Both passed in 352 s on an H100
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:?usage: scripts/gpu-tests.sh LOG_DIR [kernels|lossless|serving ...]}
shift
GROUPS_RUN=("$@")
[ ${#GROUPS_RUN[@]} -eq 0 ] && GROUPS_RUN=(kernels lossless serving)
mkdir -p "$LOG"
export VLLM_BOLE_TEST_CUDA_GRAPHS=1 VLLM_BOLE_TEST_GPU_SHARE=${VLLM_BOLE_TEST_GPU_SHARE:-0.1}
# An engine (a subprocess of its test) still running after this many seconds fails its test with its log's tail and
# its threads' stacks (tests/e2e_support.run_engine), before GROUP_TIMEOUT stops the group without them.
export VLLM_BOLE_TEST_ENGINE_TIMEOUT=${VLLM_BOLE_TEST_ENGINE_TIMEOUT:-360}
WORKERS=${WORKERS:-3}      # pytest-xdist workers (engines side by side); 1: no xdist
PYTHON=${PYTHON:-python3}
XDIST=()
[ "$WORKERS" -gt 1 ] && XDIST=(-n "$WORKERS" --dist loadfile)   # a file's tests on one worker: its reference runs once

run_group() {
  local name=$1; shift
  local start=$SECONDS limit=()
  # GROUP_TIMEOUT: seconds per group; pytest and its workers are stopped there (rc 124), and the group's log
  # still names the tests that ended (-v), so the next group gets its turn.
  [ -n "${GROUP_TIMEOUT:-}" ] && limit=(timeout --kill-after=20 "$GROUP_TIMEOUT")
  "${limit[@]}" "$PYTHON" -m pytest -p no:cacheprovider -v -rA --tb=short "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - start)) s: $(tail -n 1 "$LOG/$name.log")"
}

for group in "${GROUPS_RUN[@]}"; do
  case $group in
    kernels)
      run_group kernels "${XDIST[@]}" tests/test_kernels_triton.py tests/test_tree_attention_triton.py \
        tests/test_tree_attn_gpu_backend.py tests/test_top_children.py tests/test_kv_compaction.py \
        tests/test_beam_graphs.py ;;
    lossless)
      # One worker per test (--dist load): each starts two engines (about 300 s on the H200).
      LOSSLESS_XDIST=(); [ "$WORKERS" -gt 1 ] && LOSSLESS_XDIST=(-n "${LOSSLESS_WORKERS:-9}" --dist load)
      VLLM_BOLE_CAPTURE_AFTER=1000000 run_group lossless "${LOSSLESS_XDIST[@]}" \
        "tests/test_e2e_lossless.py::test_planted_trees_are_lossless[k2_d8]" \
        "tests/test_e2e_lossless.py::test_planted_trees_are_lossless[k2_d8_per_request_tokens48]" \
        "tests/test_e2e_lossless.py::test_mtp_tree_drafter_is_lossless_and_accepts[per_request-16-None]" \
        tests/test_e2e_lossless.py::test_mtp_drafter_with_a_draft_vocabulary_is_lossless \
        tests/test_e2e_lossless.py::test_mtp_drafter_with_a_learned_draft_vocabulary_is_lossless \
        tests/test_async_scheduling.py::test_planted_trees_async_are_lossless_and_deep \
        tests/test_async_scheduling.py::test_logprobs_and_a_request_at_max_model_len_async \
        "tests/test_e2e_lossless.py::test_mtp_chain_steps_are_lossless[per_request-True]" ;;
    calibration)
      run_group calibration tests/test_calibration.py::test_calibrate_then_serve_auto_budget ;;
    lossless-all)
      VLLM_BOLE_CAPTURE_AFTER=1000000 run_group lossless-all "${XDIST[@]}" \
        tests/test_e2e_lossless.py tests/test_async_scheduling.py ;;
    serving)
      run_group serving "${XDIST[@]}" tests/test_logits_processors.py tests/test_preemption.py \
        tests/test_structured_outputs.py tests/test_warmup.py ;;
    sampling)
      run_group sampling "${XDIST[@]}" tests/test_e2e_sampling.py ;;
    prefix-caching)
      # A worker per test (--dist load): one test's two to five engines ran past 440 s on an H100. Stand-ins
      # forced, as in lossless: verification graphs of more requests than the step's (padded requests).
      PREFIX_XDIST=(); [ "$WORKERS" -gt 1 ] && PREFIX_XDIST=(-n 5 --dist load)
      VLLM_BOLE_CAPTURE_AFTER=1000000 run_group prefix-caching "${PREFIX_XDIST[@]}" tests/test_e2e_prefix_caching.py ;;
    mixed)
      MIXED_XDIST=(); [ "$WORKERS" -gt 1 ] && MIXED_XDIST=(-n 4 --dist load)
      VLLM_BOLE_CAPTURE_AFTER=1000000 run_group mixed "${MIXED_XDIST[@]}" \
        tests/test_async_scheduling.py::test_prompt_chunks_beside_trees_draft_early_async \
        "tests/test_e2e_lossless.py::test_mtp_tree_drafter_is_lossless_and_accepts[per_request-4-48]" \
        tests/test_e2e_lossless.py::test_mixed_steps_draft_after_the_walk_when_drafting_before_it_fails \
        tests/test_e2e_prefix_caching.py::test_turns_prefilled_beside_trees_with_prefix_caching ;;
    multimodal)
      run_group multimodal tests/test_e2e_multimodal.py ;;
    moe)
      MOE_XDIST=(); [ "$WORKERS" -gt 1 ] && MOE_XDIST=(-n 2 --dist load)
      VLLM_BOLE_CAPTURE_AFTER=1000000 run_group moe "${MOE_XDIST[@]}" tests/test_e2e_moe.py ;;
    *)
      echo "unknown group $group (kernels, lossless, calibration, lossless-all, serving, sampling, prefix-caching," \
        "mixed, multimodal, moe)" >&2; exit 2 ;;
  esac
done
