#include "engine/kv/block_manager.h"

#include <map>
#include <numeric>
#include <random>

#include "engine/kv/host_kv_tier.h"
#include "engine/kv/kv_cache.h"
#include "gtest/gtest.h"

namespace duet {
namespace {

TEST(BlockManagerTest, ReserveGrowsByWholeBlocks) {
  BlockManager bm(8, 4);
  ASSERT_TRUE(bm.Reserve(1, 5, 0, nullptr).ok());
  EXPECT_EQ(bm.BlockTable(1).size(), 2u);
  EXPECT_EQ(bm.num_free_blocks(), 6);
  ASSERT_TRUE(bm.Reserve(1, 8, 5, nullptr).ok());  // still fits in two blocks
  EXPECT_EQ(bm.BlockTable(1).size(), 2u);
  ASSERT_TRUE(bm.Reserve(1, 9, 8, nullptr).ok());
  EXPECT_EQ(bm.BlockTable(1).size(), 3u);
  EXPECT_EQ(bm.Capacity(1), 12);
  bm.Free(1);
  EXPECT_EQ(bm.num_free_blocks(), 8);
  EXPECT_FALSE(bm.HasSequence(1));
}

TEST(BlockManagerTest, ExhaustionLeavesStateUnchanged) {
  BlockManager bm(3, 4);
  ASSERT_TRUE(bm.Reserve(1, 8, 0, nullptr).ok());
  absl::Status s = bm.Reserve(2, 8, 0, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(bm.HasSequence(2));
  EXPECT_EQ(bm.num_free_blocks(), 1);
  s = bm.Reserve(1, 16, 8, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(bm.BlockTable(1).size(), 2u);
}

TEST(BlockManagerTest, ForkSharesBlocksAndCopiesOnWrite) {
  BlockManager bm(8, 4);
  ASSERT_TRUE(bm.Reserve(1, 6, 0, nullptr).ok());  // blocks A (full), B (2 of 4 used)
  ASSERT_TRUE(bm.Fork(1, 2).ok());
  EXPECT_EQ(bm.BlockTable(1), bm.BlockTable(2));
  EXPECT_EQ(bm.RefCount(bm.BlockTable(1)[0]), 2);
  EXPECT_EQ(bm.BlocksNeeded(2, 7, 6), 1);  // the shared partial block needs a private copy

  std::vector<BlockCopy> copies;
  ASSERT_TRUE(bm.Reserve(2, 7, 6, &copies).ok());
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src, bm.BlockTable(1)[1]);
  EXPECT_EQ(copies[0].dst, bm.BlockTable(2)[1]);
  EXPECT_EQ(bm.BlockTable(1)[0], bm.BlockTable(2)[0]);  // full prefix block stays shared
  EXPECT_NE(bm.BlockTable(1)[1], bm.BlockTable(2)[1]);
  EXPECT_EQ(bm.RefCount(bm.BlockTable(1)[1]), 1);

  // The parent now owns its partial block alone: no copy needed to append.
  copies.clear();
  ASSERT_TRUE(bm.Reserve(1, 7, 6, &copies).ok());
  EXPECT_TRUE(copies.empty());
  bm.Free(1);
  bm.Free(2);
  EXPECT_EQ(bm.num_free_blocks(), 8);
}

TEST(BlockManagerTest, ForkErrors) {
  BlockManager bm(4, 4);
  EXPECT_EQ(bm.Fork(1, 2).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(bm.Reserve(1, 1, 0, nullptr).ok());
  ASSERT_TRUE(bm.Reserve(2, 1, 0, nullptr).ok());
  EXPECT_EQ(bm.Fork(1, 2).code(), absl::StatusCode::kAlreadyExists);
}

// Random reserve/fork/free sequences: reference counts always equal the number of tables that
// hold a block, and everything returns to the free list at the end.
TEST(BlockManagerTest, RandomOperationsNeverLeak) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 20; ++trial) {
    BlockManager bm(64, 1 + trial % 5);
    std::map<SequenceId, int64_t> filled;  // tokens written per live sequence
    SequenceId next = 1;
    for (int op = 0; op < 2000; ++op) {
      const int kind = int(rng() % 4);
      if (kind == 0 || filled.empty()) {
        const int64_t n = 1 + rng() % 20;
        if (bm.Reserve(next, n, 0, nullptr).ok()) filled[next] = n;
        ++next;
      } else {
        auto it = filled.begin();
        std::advance(it, rng() % filled.size());
        if (kind == 1) {
          const int64_t n = it->second + 1 + rng() % 6;
          std::vector<BlockCopy> copies;
          if (bm.Reserve(it->first, n, it->second, &copies).ok()) it->second = n;
        } else if (kind == 2) {
          if (bm.Fork(it->first, next).ok()) filled[next] = it->second;
          ++next;
        } else {
          bm.Free(it->first);
          filled.erase(it);
        }
      }
      std::map<int32_t, int32_t> holders;
      for (const auto& [seq, n] : filled) {
        ASSERT_GE(bm.Capacity(seq), n);
        for (int32_t b : bm.BlockTable(seq)) ++holders[b];
      }
      int32_t used = 0;
      for (int32_t b = 0; b < bm.num_blocks(); ++b) {
        ASSERT_EQ(bm.RefCount(b), holders.count(b) ? holders[b] : 0) << "block " << b;
        used += bm.RefCount(b) > 0;
      }
      ASSERT_EQ(used, bm.num_used_blocks());
    }
    for (const auto& [seq, n] : filled) bm.Free(seq);
    EXPECT_EQ(bm.num_free_blocks(), bm.num_blocks());
  }
}

// ---- Prefix caching ----

std::vector<int32_t> Iota(int32_t n, int32_t first = 0) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

std::function<int32_t(int64_t)> TokenAt(const std::vector<int32_t>& tokens) {
  return [&tokens](int64_t i) { return tokens[size_t(i)]; };
}

TEST(BlockManagerPrefixCacheTest, FinishedBlocksAreSharedByTheNextSequence) {
  BlockManager bm(8, 4);
  bm.EnablePrefixCaching();
  const std::vector<int32_t> tokens = Iota(10);  // two full blocks and a partial one
  const BlockHash seed = PrefixSeed("m", "");
  EXPECT_EQ(bm.AttachCachedPrefix(1, seed, tokens, 2), 0);  // nothing cached yet
  ASSERT_TRUE(bm.Reserve(1, 10, 0, nullptr).ok());
  bm.CommitFullBlocks(1, seed, 10, TokenAt(tokens));
  EXPECT_EQ(bm.num_cached_blocks(), 2);  // the partial block is not cached
  const std::vector<int32_t> first = bm.BlockTable(1);
  bm.Free(1);
  EXPECT_EQ(bm.num_free_blocks(), 8);  // cached blocks still count as free

  EXPECT_EQ(bm.AttachCachedPrefix(2, seed, tokens, 2), 8);
  EXPECT_EQ(bm.BlockTable(2), std::vector<int32_t>(first.begin(), first.begin() + 2));
  EXPECT_EQ(bm.num_free_blocks(), 6);
  // A live sequence's blocks are shared, not copied.
  EXPECT_EQ(bm.AttachCachedPrefix(3, seed, tokens, 2), 8);
  EXPECT_EQ(bm.RefCount(first[0]), 2);
  // Another salt, or other tokens, share nothing.
  EXPECT_EQ(bm.AttachCachedPrefix(4, PrefixSeed("m", "salt"), tokens, 2), 0);
  std::vector<int32_t> other = tokens;
  other[5] = 99;  // inside block 1
  EXPECT_EQ(bm.AttachCachedPrefix(5, seed, other, 2), 4);
  // max_blocks bounds the match.
  EXPECT_EQ(bm.AttachCachedPrefix(6, seed, tokens, 1), 4);
}

TEST(BlockManagerPrefixCacheTest, ResetForgetsUnheldBlocksOnly) {
  BlockManager bm(8, 4);
  bm.EnablePrefixCaching();
  const BlockHash seed = PrefixSeed("m", "");
  const std::vector<int32_t> a = Iota(8, 0), b = Iota(8, 100);
  for (SequenceId seq : {1, 2}) {
    ASSERT_TRUE(bm.Reserve(seq, 8, 0, nullptr).ok());
    bm.CommitFullBlocks(seq, seed, 8, TokenAt(seq == 1 ? a : b));
  }
  bm.Free(1);  // a's blocks are unheld; b's are still held by sequence 2
  bm.ResetPrefixCache();
  EXPECT_EQ(bm.num_cached_blocks(), 2);
  EXPECT_EQ(bm.num_free_blocks(), 6);
  EXPECT_EQ(bm.AttachCachedPrefix(3, seed, a, 2), 0);
  EXPECT_EQ(bm.AttachCachedPrefix(4, seed, b, 2), 8);
  bm.Free(2);
  bm.Free(4);
  EXPECT_EQ(bm.num_free_blocks(), 8);
  EXPECT_EQ(bm.num_evictions(), 0);  // a reset is not an eviction
}

TEST(BlockManagerPrefixCacheTest, EvictsLeastRecentlyUsedAndTailsFirst) {
  BlockManager bm(4, 2);
  bm.EnablePrefixCaching();
  const BlockHash seed = PrefixSeed("m", "");
  const std::vector<int32_t> a = Iota(4, 0), b = Iota(4, 100);
  for (SequenceId seq : {1, 2}) {
    const std::vector<int32_t>& t = seq == 1 ? a : b;
    ASSERT_TRUE(bm.Reserve(seq, 4, 0, nullptr).ok());
    bm.CommitFullBlocks(seq, seed, 4, TokenAt(t));
  }
  bm.Free(1);  // a's blocks are older
  bm.Free(2);
  EXPECT_EQ(bm.num_cached_blocks(), 4);
  // One new block evicts a's tail: a's first block still hits, its second does not.
  ASSERT_TRUE(bm.Reserve(3, 1, 0, nullptr).ok());
  EXPECT_EQ(bm.num_evictions(), 1);
  EXPECT_EQ(bm.AttachCachedPrefix(4, seed, a, 2), 2);
  EXPECT_EQ(bm.AttachCachedPrefix(5, seed, b, 2), 4);
}

TEST(BlockManagerPrefixCacheTest, DuplicateComputationKeepsOneCachedCopy) {
  BlockManager bm(8, 4);
  bm.EnablePrefixCaching();
  const BlockHash seed = PrefixSeed("m", "");
  const std::vector<int32_t> tokens = Iota(8);
  for (SequenceId seq : {1, 2}) {  // both computed the same prompt at once
    ASSERT_TRUE(bm.Reserve(seq, 8, 0, nullptr).ok());
  }
  for (SequenceId seq : {1, 2}) bm.CommitFullBlocks(seq, seed, 8, TokenAt(tokens));
  EXPECT_EQ(bm.num_cached_blocks(), 2);
  bm.Free(1);
  bm.Free(2);
  EXPECT_EQ(bm.num_free_blocks(), 8);
  EXPECT_EQ(bm.AttachCachedPrefix(3, seed, tokens, 2), 8);
}

// A KV cache whose "K/V" for a token at a position is a value derived from both, so a test can
// read back what any block holds.
class ContentCache {
 public:
  ContentCache(int32_t num_blocks, int32_t block_size)
      : cache_(std::move(HostKvCache::Create(KvCacheShape{1, num_blocks, 1, block_size, 1, KvDtype::kFloat32})).value()),
        block_size_(block_size) {}
  static float Value(int32_t token, int64_t position) { return float(token) * 1000.0f + float(position); }
  void Write(const std::vector<int32_t>& table, int64_t position, int32_t token) {
    cache_->keys(0)[cache_->Offset(table[size_t(position / block_size_)], 0, position % block_size_)] =
        Value(token, position);
  }
  float Read(const std::vector<int32_t>& table, int64_t position) {
    return cache_->keys(0)[cache_->Offset(table[size_t(position / block_size_)], 0, position % block_size_)];
  }
  HostKvCache& cache() { return *cache_; }

 private:
  std::unique_ptr<HostKvCache> cache_;
  int32_t block_size_;
};

// Random admit / extend / fork / truncate / free over a small cache whose blocks are evicted to
// a smaller host tier: reference counts always match the tables, nothing leaks, and every block a
// sequence is handed from either tier holds exactly its tokens' K/V.
TEST(BlockManagerPrefixCacheTest, RandomOperationsNeverLeakOrHandOutWrongKv) {
  std::mt19937 rng(99);
  for (int trial = 0; trial < 12; ++trial) {
    const int32_t block_size = 1 + (trial / 2) % 4;
    ContentCache content(32, block_size);
    absl::StatusOr<std::unique_ptr<HostKvTier>> tier =
        HostKvTier::Create(content.cache(), 16 * content.cache().shape().bytes_per_block());
    ASSERT_TRUE(tier.ok()) << tier.status();
    BlockManager bm(32, block_size);
    bm.EnablePrefixCaching(trial % 2 == 0 ? tier->get() : nullptr);
    const BlockHash seed = PrefixSeed("m", "");
    // Prompts start with one of eight documents, so prefixes repeat but do not all fit.
    std::vector<std::vector<int32_t>> documents;
    for (int d = 0; d < 8; ++d) {
      std::vector<int32_t> doc;
      for (int i = 0; i < 24; ++i) doc.push_back(int32_t(rng() % 50));
      documents.push_back(doc);
    }
    struct Live {
      std::vector<int32_t> tokens;
      int64_t computed = 0;
    };
    std::map<SequenceId, Live> live;
    SequenceId next = 1;
    int64_t hits = 0;
    auto compute = [&](SequenceId seq, Live& l, int64_t upto) {
      ASSERT_TRUE((*tier)->Flush(HostKvTier::FlushMode::kWait).ok());  // evictions out, hits in, before the writes
      for (int64_t p = 0; p < l.computed; ++p) {
        ASSERT_EQ(content.Read(bm.BlockTable(seq), p), ContentCache::Value(l.tokens[size_t(p)], p))
            << "trial " << trial << " seq " << seq << " position " << p;
      }
      for (int64_t p = l.computed; p < upto; ++p) content.Write(bm.BlockTable(seq), p, l.tokens[size_t(p)]);
      l.computed = upto;
      bm.CommitFullBlocks(seq, seed, upto, TokenAt(l.tokens));
    };
    for (int op = 0; op < 1500; ++op) {
      const int kind = live.size() > 4 ? 4 : int(rng() % 5);  // a few live sequences, the rest cached
      if (kind == 0 || live.empty()) {
        Live l;
        l.tokens = documents[std::min(rng() % documents.size(), rng() % documents.size())];  // skewed
        l.tokens.resize(rng() % 25);  // any prefix of it, then a few own tokens
        for (int i = int(rng() % 6); i >= 0; --i) l.tokens.push_back(int32_t(rng() % 50));
        const SequenceId seq = next++;
        l.computed = bm.AttachCachedPrefix(seq, seed, l.tokens, int32_t((l.tokens.size() - 1) / size_t(block_size)));
        hits += l.computed;
        if (!bm.Reserve(seq, int64_t(l.tokens.size()), l.computed, nullptr).ok()) {
          bm.Free(seq);
          continue;
        }
        compute(seq, l, int64_t(l.tokens.size()));
        live.emplace(seq, std::move(l));
      } else {
        auto it = live.begin();
        std::advance(it, rng() % live.size());
        Live& l = it->second;
        if (kind == 1) {  // decode a few tokens
          const int64_t n = int64_t(l.tokens.size()) + 1 + int64_t(rng() % 4);
          std::vector<BlockCopy> copies;
          if (!bm.Reserve(it->first, n, l.computed, &copies).ok()) continue;
          ASSERT_TRUE((*tier)->Flush(HostKvTier::FlushMode::kOrdered).ok());  // as a step runs them: tier copies, then copy-on-write
          content.cache().CopyBlocks(copies);
          while (int64_t(l.tokens.size()) < n) l.tokens.push_back(int32_t(rng() % 50));
          compute(it->first, l, n);
        } else if (kind == 2) {
          if (bm.Fork(it->first, next).ok()) live.emplace(next, l);
          ++next;
        } else if (kind == 3) {  // speculative slots reserved, then given back
          std::vector<BlockCopy> copies;
          if (bm.Reserve(it->first, l.computed + 1 + int64_t(rng() % 5), l.computed, &copies).ok()) {
            ASSERT_TRUE((*tier)->Flush(HostKvTier::FlushMode::kOrdered).ok());  // as a step runs them: tier copies, then copy-on-write
          content.cache().CopyBlocks(copies);
            bm.Truncate(it->first, l.computed);
          }
        } else {
          bm.Free(it->first);
          live.erase(it);
        }
      }
      std::map<int32_t, int32_t> holders;
      for (const auto& [seq, l] : live) {
        ASSERT_GE(bm.Capacity(seq), l.computed);
        for (int32_t b : bm.BlockTable(seq)) ++holders[b];
      }
      int32_t used = 0;
      for (int32_t b = 0; b < bm.num_blocks(); ++b) {
        ASSERT_EQ(bm.RefCount(b), holders.count(b) ? holders[b] : 0) << "block " << b;
        used += bm.RefCount(b) > 0;
      }
      ASSERT_EQ(used, bm.num_used_blocks());
      ASSERT_LE(bm.num_cached_blocks(), bm.num_blocks());
    }
    for (const auto& [seq, l] : live) bm.Free(seq);
    EXPECT_EQ(bm.num_free_blocks(), bm.num_blocks());
    EXPECT_GT(hits, 0) << "trial " << trial << ": the workload never hit the cache";
    if (trial % 2 == 0) {
      EXPECT_GT((*tier)->stats().offloaded_blocks, 0);
      EXPECT_GT((*tier)->stats().loaded_blocks, 0) << "trial " << trial << ": the host tier never served a hit";
    }
  }
}

}  // namespace
}  // namespace duet
