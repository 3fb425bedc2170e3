#include "kernels/attention/kv_slot_move.h"

#include <vector>

#include <gtest/gtest.h>

#include "kernels/kernel_test_util.h"

namespace duet::kernels {
namespace {


struct Move {
  int32_t from, to;
};

// Applies `moves` in order on the host and on the device (in launches of at most
// kMaxKvSlotMoves) to random pools (an even number: K and V of each layer) and compares every
// element.
void RunAndCompare(int num_pools, int num_blocks, int num_kv_heads, int block_size, int head_dim,
                   const std::vector<Move>& moves, uint64_t seed) {
  const int64_t pool_elems = int64_t(num_blocks) * num_kv_heads * block_size * head_dim;
  std::vector<float> host = testing::RoundToBf16(testing::RandomFloats(size_t(pool_elems) * num_pools, seed));
  DeviceBuffer<__nv_bfloat16> device(testing::ToBf16(host));
  for (const Move& m : moves) {
    for (int p = 0; p < num_pools; ++p) {
      for (int h = 0; h < num_kv_heads; ++h) {
        auto row = [&](int32_t slot) {
          return size_t(p) * size_t(pool_elems) +
                 ((size_t(slot / block_size) * num_kv_heads + h) * block_size + slot % block_size) * head_dim;
        };
        for (int d = 0; d < head_dim; ++d) host[row(m.to) + d] = host[row(m.from) + d];
      }
    }
  }
  for (size_t begin = 0; begin < moves.size(); begin += kMaxKvSlotMoves) {
    // The pools alternate K and V of each layer, like DeviceKvCache's.
    KvSlotMoveParams params{};
    params.first_layer = {device.get(), device.get() + pool_elems, num_kv_heads, block_size, head_dim};
    params.layer_stride = 2 * pool_elems;
    params.num_layers = num_pools / 2;
    params.num_moves = int(std::min<size_t>(kMaxKvSlotMoves, moves.size() - begin));
    for (int i = 0; i < params.num_moves; ++i) {
      params.from[i] = moves[begin + size_t(i)].from;
      params.to[i] = moves[begin + size_t(i)].to;
    }
    MoveKvSlots(params, nullptr);
  }
  DUET_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(testing::ToFloat(device.Download()), host);
}

// The accepted path of a tree after a root in slot 20 (block 1 of 16), nodes 3, 5, 6 and 9:
// node 3 moves to slot 21 before node 6's move to slot 23 overwrites node 3's old slot 23.
TEST(KvSlotMove, Bf16AcceptedPathAcrossBlocks) {
  DUET_SKIP_WITHOUT_GPU();
  RunAndCompare(6, 8, 4, 16, 128, {{23, 21}, {25, 22}, {26, 23}, {29, 24}}, 1);
}

TEST(KvSlotMove, Bf16HeadDim64ManyPools) {
  DUET_SKIP_WITHOUT_GPU();
  RunAndCompare(64, 4, 8, 32, 64, {{40, 33}, {70, 34}}, 2);
}

// More moves than one launch carries: a long accepted chain in block size 8.
TEST(KvSlotMove, Bf16LongPathTwoLaunches) {
  DUET_SKIP_WITHOUT_GPU();
  std::vector<Move> moves;
  for (int i = 0; i < 90; ++i) moves.push_back({100 + 2 * i + 2, 100 + i + 1});
  RunAndCompare(4, 64, 2, 8, 128, moves, 3);
}

}  // namespace
}  // namespace duet::kernels
