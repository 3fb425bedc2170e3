#include "parallel/ring_schedule.h"

#include "common/check.h"

namespace duet::parallel {

std::vector<int64_t> RingAttentionSchedule::RowPositions() const {
  std::vector<int64_t> positions;
  positions.reserve(static_cast<size_t>(num_tokens));
  for (int rank = 0; rank < size; ++rank) {
    const std::vector<int64_t> own = RankPositions(num_tokens, rank, size);
    positions.insert(positions.end(), own.begin(), own.end());
  }
  return positions;
}

RingAttentionSchedule PlanRingAttention(int64_t num_tokens, int size) {
  DUET_CHECK(size >= 1);
  DUET_CHECK(num_tokens >= 2 * int64_t{size});
  RingAttentionSchedule schedule;
  schedule.size = size;
  schedule.num_tokens = num_tokens;
  schedule.rank_rows.assign(static_cast<size_t>(size) + 1, 0);
  std::vector<std::array<TokenChunk, 2>> chunks;
  for (int rank = 0; rank < size; ++rank) {
    chunks.push_back(RankChunks(num_tokens, rank, size));
    schedule.rank_rows[rank + 1] = schedule.rank_rows[rank] + chunks[rank][0].size() + chunks[rank][1].size();
  }
  schedule.steps.resize(static_cast<size_t>(size));
  for (int step = 0; step < size; ++step) {
    for (int rank = 0; rank < size; ++rank) {
      const int source = schedule.SourceOf(rank, step);
      const int64_t row = schedule.rank_rows[rank];
      const int64_t a = chunks[rank][0].size(), b = chunks[rank][1].size();
      const int64_t block = chunks[source][0].size() + chunks[source][1].size();
      std::vector<RingAttentionCall>& calls = schedule.steps[step];
      if (source == rank) {
        calls.push_back({rank, source, row, a, a, a});
        calls.push_back({rank, source, row + a, b, a + b, a + b});
      } else if (source < rank) {
        const int64_t seen = chunks[source][0].size();
        calls.push_back({rank, source, row, a + b, seen + a + b, seen});
      } else {
        calls.push_back({rank, source, row + a, b, block + b, block});
      }
    }
  }
  return schedule;
}

}  // namespace duet::parallel
