// Integrity of the KV targets a decode worker grants: a prefill worker writes a prompt's KV only
// into blocks that a decode worker reserved for exactly that transfer.
//
// Threat model. The KV transport cannot confine a writer to some blocks: a receiver descriptor
// carries remote keys (UCX) or CUDA IPC handles for whole pools, and the bytes land before any
// notice names the transfer, so the receiver could at best notice a stray write after it has
// clobbered another request's KV. The one place to stop it is the writer, the prefill worker,
// before it connects or writes. What it writes where comes from PrefillRequest.target, which the
// router copies from the decode worker's ReserveKv reply. Without a check, whoever can call
// Prefill (anyone who reaches the port, when no internal token is set; a router bug that mixes
// two requests' targets, otherwise) chooses the descriptor and the block ids: it overwrites
// another request's KV (wrong or leaked output for that client), or points the prefill worker at
// memory behind a crafted descriptor.
//
// Defence: the decode worker authenticates every target it grants with HMAC-SHA256 over the
// descriptor, the transfer id and both block lists, under a key derived from the cluster's
// internal token (rpc/internal_auth.h); the prefill worker refuses (PERMISSION_DENIED) a target
// whose authenticator is missing or does not match, so a Prefill can only write into a
// reservation the decode worker made, for the transfer id it made it for. Together with the
// token on every internal RPC this leaves the holders of the token — the router and the workers,
// all trusted — as the only ones able to forge a target. Not covered: an on-path attacker (no
// TLS), and replay of a granted target by a token holder within its lease. Without a token
// (backward compatibility) targets are neither signed nor checked, and workers warn at start-up.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "duet/v1/worker.pb.h"

namespace duet::rpc {

// The MAC key of KV targets from the internal token; "" (no signing, no checking) without one.
std::string KvTargetKey(std::string_view internal_token);
// Sets target->authenticator for its current contents (nothing without a key).
void SignKvTarget(std::string_view key, v1::KvTarget* target);
// OK for a target signed with `key` (or any target when the key is empty), else
// PERMISSION_DENIED.
absl::Status VerifyKvTarget(std::string_view key, const v1::KvTarget& target);

}  // namespace duet::rpc
