#include "backends/cuda/step_metadata.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/check.h"
#include "kernels/copy/previous_samples.h"

namespace duet::cuda {

StepMetadataLayout::StepMetadataLayout(int max_tokens, int max_seqs, int max_rows, int max_blocks_per_seq) {
  size_t at = 0;
  auto take = [&](size_t n) {
    at = (at + 3) / 4 * 4;  // 16-byte aligned arrays
    const size_t begin = at;
    at += n;
    return begin;
  };
  tokens = take(max_tokens);
  positions = take(max_tokens);
  slots = take(max_tokens);
  q_start = take(max_seqs + 1);
  context_lens = take(max_seqs);
  logit_rows = take(max_tokens);
  block_tables = take(size_t(max_seqs) * max_blocks_per_seq);
  tree_masks = take(2 * size_t(max_tokens));
  // The seven per-row sampling arrays sit sampling_pitch units apart (room for 8-byte rows),
  // so one 2-D copy uploads the used rows of all of them.
  sampling_pitch = (2 * size_t(max_rows) + 3) / 4 * 4;
  temperature = take(sampling_pitch);
  top_k = take(sampling_pitch);
  top_p = take(sampling_pitch);
  min_p = take(sampling_pitch);
  seeds = take(sampling_pitch);
  offsets = take(sampling_pitch);
  bitmask_index = take(sampling_pitch);
  sampled_tokens = take(max_rows);
  sampled_logprobs = take(max_rows);
  total = take(0);
}

StepMetadata::StepMetadata(const StepLimits& limits, int block_size, int max_blocks_per_seq)
    : limits_(limits),
      block_size_(block_size),
      max_blocks_per_seq_(max_blocks_per_seq),
      layout_(limits.max_num_batched_tokens, limits.max_num_seqs, limits.max_num_batched_tokens, max_blocks_per_seq),
      bitmask_words_(int((limits.vocab_size + 31) / 32)) {}

absl::StatusOr<std::unique_ptr<StepMetadata>> StepMetadata::Create(const StepLimits& limits, int block_size,
                                                                   DeviceArena& arena) {
  const int max_blocks_per_seq = int((limits.max_model_len + block_size - 1) / block_size);
  std::unique_ptr<StepMetadata> m(new StepMetadata(limits, block_size, max_blocks_per_seq));
  const size_t bytes = m->layout_.total * 4;
  DUET_ASSIGN_OR_RETURN(m->device_, arena.Allocate(bytes, "step metadata"));
  DUET_RETURN_IF_ERROR(m->host_.Resize(bytes));
  DUET_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&m->uploaded_, cudaEventDisableTiming), "upload event"));
  std::memset(m->host(), 0, bytes);
  const size_t mask_bytes = size_t(limits.max_num_seqs) * size_t(m->bitmask_words_) * 4;
  DUET_ASSIGN_OR_RETURN(m->bitmasks_device_, arena.Allocate(mask_bytes, "grammar token masks"));
  DUET_RETURN_IF_ERROR(m->bitmasks_host_.Resize(mask_bytes));
  return m;
}

StepMetadata::~StepMetadata() {
  if (uploaded_ != nullptr) cudaEventDestroy(uploaded_);
}

void StepMetadata::WaitForLastUpload() { DUET_CHECK_CUDA(cudaEventSynchronize(uploaded_)); }

absl::StatusOr<StepPlan> StepMetadata::Plan(absl::Span<const SequenceChunk> chunks, bool previous_samples) {
  WaitForLastUpload();
  StepPlan plan;
  if (chunks.empty()) return absl::InvalidArgumentError("empty step");
  if (int(chunks.size()) > limits_.max_num_seqs) {
    return absl::InvalidArgumentError(absl::StrCat("step has ", chunks.size(), " sequences; max_num_seqs is ",
                                                   limits_.max_num_seqs));
  }
  const StepMetadataLayout& layout = layout_;
  const int block_size = block_size_;
  int32_t* meta = host();
  int32_t* tokens = meta + layout.tokens;
  int32_t* positions = meta + layout.positions;
  int32_t* slots = meta + layout.slots;
  int32_t* q_start = meta + layout.q_start;
  int32_t* context_lens = meta + layout.context_lens;
  int32_t* block_tables = meta + layout.block_tables;
  int32_t* logit_rows = meta + layout.logit_rows;
  auto* tree_masks = reinterpret_cast<uint64_t*>(meta + layout.tree_masks);

  plan.decode_only = true;
  bool leading_decode = true;
  std::vector<int32_t> depths;
  int row = 0, logit_row = 0;
  q_start[0] = 0;
  for (size_t s = 0; s < chunks.size(); ++s) {
    const SequenceChunk& chunk = chunks[s];
    const int n = int(chunk.tokens.size());
    const int64_t end = chunk.start_position + n;
    if (n == 0) return absl::InvalidArgumentError("empty chunk");
    if (end > limits_.max_model_len) {
      return absl::InvalidArgumentError(absl::StrCat("sequence reaches position ", end, " past max_model_len ",
                                                     limits_.max_model_len));
    }
    if (end > int64_t(chunk.block_table.size()) * block_size) return absl::InternalError("block table too short for the chunk");
    if (chunk.num_logits < 0 || chunk.num_logits > n) return absl::InternalError("num_logits exceeds the chunk");
    if (row + n > limits_.max_num_batched_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("step has more than max_num_batched_tokens (",
                                                     limits_.max_num_batched_tokens, ") tokens"));
    }
    if (n != 1 || chunk.num_logits != 1) plan.decode_only = false;
    leading_decode = leading_decode && n == 1 && chunk.tree_parents.empty();
    if (leading_decode) ++plan.num_leading_decode_seqs;
    // A draft tree: token j takes position start + depth(j) but slot start + j, and sees the
    // context plus its ancestors (its mask: itself and its parent's mask).
    const bool tree = !chunk.tree_parents.empty();
    if (tree) {
      if (chunk.tree_parents.size() != size_t(n) || chunk.tree_parents[0] != -1) {
        return absl::InternalError("a draft tree needs one parent per token and token 0 as its root");
      }
      if (n > 64) return absl::InvalidArgumentError("a draft tree has at most 64 tokens on the CUDA backend");
      depths.assign(size_t(n), 0);
      plan.has_trees = true;
    }
    for (int j = 0; j < n; ++j) {
      const int32_t id = chunk.tokens[size_t(j)];
      if (previous_samples && IsPreviousStepSample(id)) {
        if (PreviousStepSampleRow(id) >= limits_.max_num_batched_tokens) {
          return absl::InvalidArgumentError(absl::StrCat("previous step's row ", PreviousStepSampleRow(id), " out of range"));
        }
        plan.has_previous_samples = true;
      } else if (id < 0 || id >= limits_.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("token id ", id, " out of range"));
      }
      const int64_t slot = chunk.start_position + j;
      int64_t pos = slot;
      uint64_t mask = ~uint64_t{0};
      if (tree && j > 0) {
        const int32_t parent = chunk.tree_parents[size_t(j)];
        if (parent < 0 || parent >= j) return absl::InternalError("a draft tree token's parent must come before it");
        depths[size_t(j)] = depths[size_t(parent)] + 1;
        pos = chunk.start_position + depths[size_t(j)];
        mask = (uint64_t{1} << j) | tree_masks[row + parent];
      } else if (tree) {
        mask = 1;
      }
      tokens[row + j] = id;
      positions[row + j] = int32_t(pos);
      slots[row + j] = chunk.block_table[size_t(slot / block_size)] * block_size + int32_t(slot % block_size);
      tree_masks[row + j] = mask;
    }
    for (int j = n - chunk.num_logits; j < n; ++j) logit_rows[logit_row++] = row + j;
    const int num_blocks = int((end + block_size - 1) / block_size);
    std::memcpy(block_tables + s * size_t(max_blocks_per_seq_), chunk.block_table.data(), size_t(num_blocks) * 4);
    context_lens[s] = int32_t(end);
    row += n;
    q_start[s + 1] = row;
    plan.max_q_len = std::max(plan.max_q_len, n);
    plan.max_context_len = std::max(plan.max_context_len, int(end));
  }
  plan.num_tokens = row;
  plan.num_seqs = int(chunks.size());
  plan.num_logit_rows = logit_row;
  // Decode and verification steps replay graphs, whose kernels keep the sequence counts they were
  // captured with: those keep their one attention kernel.
  if (plan.decode_only || plan.has_trees) plan.num_leading_decode_seqs = 0;
  return plan;
}

absl::StatusOr<StepPlan> StepMetadata::PlanRows(const SequenceChunk& chunk, absl::Span<const int64_t> positions) {
  WaitForLastUpload();
  const int64_t n = int64_t(chunk.tokens.size());
  if (chunk.start_position != 0 || !chunk.tree_parents.empty()) {
    return absl::InternalError("a sequence-parallel shard comes from a prompt chunk at position 0");
  }
  if (positions.empty() || int64_t(positions.size()) > limits_.max_num_batched_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("a shard of ", positions.size(), " rows does not fit a step of ",
                                                   limits_.max_num_batched_tokens, " tokens"));
  }
  if (n > limits_.max_model_len) {
    return absl::InvalidArgumentError(absl::StrCat("sequence reaches position ", n, " past max_model_len ",
                                                   limits_.max_model_len));
  }
  if (n > int64_t(chunk.block_table.size()) * block_size_) return absl::InternalError("block table too short for the chunk");
  if (chunk.num_logits < 0 || chunk.num_logits > n) return absl::InternalError("num_logits exceeds the chunk");
  int32_t* meta = host();
  const StepMetadataLayout& layout = layout_;
  std::vector<std::pair<int64_t, int32_t>> logit_rows;  // (position, row)
  for (size_t i = 0; i < positions.size(); ++i) {
    const int64_t pos = positions[i];
    if (pos < 0 || pos >= n) return absl::InternalError("shard position outside the chunk");
    const int32_t id = chunk.tokens[size_t(pos)];
    if (id < 0 || id >= limits_.vocab_size) return absl::InvalidArgumentError(absl::StrCat("token id ", id, " out of range"));
    meta[layout.tokens + i] = id;
    meta[layout.positions + i] = int32_t(pos);
    meta[layout.slots + i] = chunk.block_table[size_t(pos / block_size_)] * block_size_ + int32_t(pos % block_size_);
    if (pos >= n - chunk.num_logits) logit_rows.emplace_back(pos, int32_t(i));
  }
  std::sort(logit_rows.begin(), logit_rows.end());
  for (size_t r = 0; r < logit_rows.size(); ++r) meta[layout.logit_rows + r] = logit_rows[r].second;
  StepPlan plan;
  plan.num_tokens = int(positions.size());
  plan.num_seqs = 1;
  plan.num_logit_rows = int(logit_rows.size());
  plan.max_q_len = plan.num_tokens;
  meta[layout.q_start] = 0;
  meta[layout.q_start + 1] = plan.num_tokens;
  meta[layout.context_lens] = 0;
  return plan;
}

void StepMetadata::ReorderRows(const StepPlan& plan, absl::Span<const int64_t> order) {
  DUET_CHECK(plan.num_seqs == 1 && !plan.has_trees && int64_t(order.size()) == plan.num_tokens);
  int32_t* meta = host();
  std::vector<int32_t> new_row(order.size());
  for (size_t field : {layout_.tokens, layout_.positions, layout_.slots}) {
    const std::vector<int32_t> old(meta + field, meta + field + order.size());
    for (size_t i = 0; i < order.size(); ++i) meta[field + i] = old[size_t(order[i])];
  }
  for (size_t i = 0; i < order.size(); ++i) new_row[size_t(order[i])] = int32_t(i);
  for (int r = 0; r < plan.num_logit_rows; ++r) {
    meta[layout_.logit_rows + r] = new_row[size_t(meta[layout_.logit_rows + r])];
  }
}

void StepMetadata::PadForGraph(StepPlan& plan, int batch) {
  const StepMetadataLayout& layout = layout_;
  int32_t* meta = host();
  for (int i = plan.num_seqs; i < batch; ++i) {
    meta[layout.tokens + i] = 0;
    meta[layout.positions + i] = 0;
    meta[layout.slots + i] = -1;            // writes no K/V
    meta[layout.context_lens + i] = 0;      // attends to nothing
    meta[layout.q_start + i + 1] = i + 1;
    meta[layout.logit_rows + i] = i;
  }
  plan.num_tokens = plan.num_seqs = plan.num_logit_rows = batch;
  plan.graph_batch = batch;
}

void StepMetadata::PadTreeStepForGraph(StepPlan& plan, int batch, int tokens) {
  const StepMetadataLayout& layout = layout_;
  int32_t* meta = host();
  auto* tree_masks = reinterpret_cast<uint64_t*>(meta + layout.tree_masks);
  // Padding rows follow the real ones and belong to no sequence: they write no K/V, no query
  // attends to them, and their logits go unused.
  for (int i = plan.num_tokens; i < tokens; ++i) {
    meta[layout.tokens + i] = 0;
    meta[layout.positions + i] = 0;
    meta[layout.slots + i] = -1;
    meta[layout.logit_rows + i] = i;
    tree_masks[i] = 1;
  }
  for (int s = plan.num_seqs; s < batch; ++s) {
    meta[layout.context_lens + s] = 0;
    meta[layout.q_start + s + 1] = plan.num_tokens;  // no queries
  }
  plan.num_tokens = plan.num_logit_rows = tokens;
  plan.num_seqs = batch;
  plan.max_q_len = kTreeGraphMaxChunkTokens;
  plan.graph_batch = batch;
  plan.graph_tokens = tokens;
}

StepPlan StepMetadata::PaddingOnly(int batch, int tree_tokens) {
  WaitForLastUpload();
  StepPlan plan;
  host()[layout_.q_start] = 0;
  if (tree_tokens > 0) {
    plan.has_trees = true;
    PadTreeStepForGraph(plan, batch, tree_tokens);
  } else {
    plan.decode_only = true;
    PadForGraph(plan, batch);
  }
  return plan;
}

void StepMetadata::Upload(const StepPlan& plan, absl::Span<const DeviceSamplingRow> sampling, cudaStream_t stream,
                          bool with_bitmasks) {
  const StepMetadataLayout& layout = layout_;
  int32_t* host_meta = host();
  int32_t* dev = device();
  auto copy = [&](size_t offset, size_t count) {
    if (count == 0) return;
    DUET_CHECK_CUDA(cudaMemcpyAsync(dev + offset, host_meta + offset, count * 4, cudaMemcpyHostToDevice, stream));
  };
  // tokens, positions, slots, q_start, context_lens and logit_rows are laid out back to back.
  copy(layout.tokens, layout.block_tables - layout.tokens);
  if (plan.has_trees) copy(layout.tree_masks, 2 * size_t(plan.num_tokens));
  // Only each row's used prefix of the block table travels.
  const size_t pitch = size_t(max_blocks_per_seq_) * 4;
  const size_t used = size_t((plan.max_context_len + block_size_ - 1) / block_size_) * 4;
  if (used > 0) {
    DUET_CHECK_CUDA(cudaMemcpy2DAsync(dev + layout.block_tables, pitch, host_meta + layout.block_tables, pitch, used,
                                      size_t(plan.num_seqs), cudaMemcpyHostToDevice, stream));
  }
  if (!sampling.empty()) {
    const int rows = plan.num_logit_rows;
    auto* temperature = reinterpret_cast<float*>(host_meta + layout.temperature);
    int32_t* top_k = host_meta + layout.top_k;
    auto* top_p = reinterpret_cast<float*>(host_meta + layout.top_p);
    auto* min_p = reinterpret_cast<float*>(host_meta + layout.min_p);
    auto* seeds = reinterpret_cast<uint64_t*>(host_meta + layout.seeds);
    auto* offsets = reinterpret_cast<uint64_t*>(host_meta + layout.offsets);
    int32_t* bitmask_index = host_meta + layout.bitmask_index;
    int num_masks = 0;
    for (int i = 0; i < rows; ++i) {
      bitmask_index[i] = -1;
      if (size_t(i) >= sampling.size()) {  // graph padding rows: greedy
        temperature[i] = 0.0f;
        continue;
      }
      const DeviceSamplingRow& row = sampling[size_t(i)];
      temperature[i] = row.temperature;
      top_k[i] = row.top_k;
      top_p[i] = row.top_p;
      min_p[i] = row.min_p;
      seeds[i] = row.seed;
      offsets[i] = row.offset;
      if (row.allowed_tokens.empty()) continue;
      DUET_CHECK(num_masks < limits_.max_num_seqs && row.allowed_tokens.size() == size_t(bitmask_words_));
      bitmask_index[i] = num_masks++;
    }
    const size_t sampling_pitch = layout.sampling_pitch * 4;
    DUET_CHECK_CUDA(cudaMemcpy2DAsync(dev + layout.temperature, sampling_pitch, host_meta + layout.temperature,
                                      sampling_pitch, size_t(rows) * 8, 7, cudaMemcpyHostToDevice, stream));
    if (with_bitmasks) UploadBitmasks(sampling, stream);
  }
  DUET_CHECK_CUDA(cudaEventRecord(uploaded_, stream));
}

void StepMetadata::ResolvePreviousSamples(const StepPlan& plan, cudaStream_t stream) {
  if (!plan.has_previous_samples) return;
  kernels::ResolvePreviousStepSamples(device() + layout_.tokens, plan.num_tokens, sampled_tokens(), stream);
}

void StepMetadata::UploadBitmasks(absl::Span<const DeviceSamplingRow> sampling, cudaStream_t stream) {
  // In row order, as Upload numbered them.
  auto* bitmasks = bitmasks_host_.as<uint32_t>();
  size_t num_masks = 0;
  for (const DeviceSamplingRow& row : sampling) {
    if (row.allowed_tokens.empty()) continue;
    std::memcpy(bitmasks + num_masks++ * size_t(bitmask_words_), row.allowed_tokens.data(), size_t(bitmask_words_) * 4);
  }
  if (num_masks > 0) {
    DUET_CHECK_CUDA(cudaMemcpyAsync(bitmasks_device_.as<uint32_t>(), bitmasks, num_masks * size_t(bitmask_words_) * 4,
                                    cudaMemcpyHostToDevice, stream));
  }
}

}  // namespace duet::cuda
