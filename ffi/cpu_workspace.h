// The CPU handler's shared state: the workspace of one group at one call site (slots, flags,
// the poison word) and the process-wide registry that joins the ranks of a call and keeps the
// workspaces and bindings (ffi/echo_allreduce_cpu.cc describes both). Included by
// echo_allreduce_cpu.cc only.
#ifndef ECHO_JAX_FFI_CPU_WORKSPACE_H_
#define ECHO_JAX_FFI_CPU_WORKSPACE_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_call.h"
#include "ffi_helpers.h"
#include "xla/ffi/api/ffi.h"

namespace echo {
namespace cpu {
namespace {

constexpr size_t kMaxWorkspaces = 1024;    // LRU cap of the persistent workspaces
constexpr size_t kMaxCachedBindings = 1 << 14;  // (device, call site) bindings

// -------------------------------------------------------------------------------------------
// Workspace of one group at one call site.
// -------------------------------------------------------------------------------------------

struct alignas(64) Flag {
  std::atomic<int64_t> value{2};  // "call 0 has completed": see the header comment
};

struct alignas(64) RankState {
  std::mutex call_mu;             // one call of this rank at a time on this workspace
  int64_t epoch = 0;              // calls this rank started here (guarded by call_mu)
  std::atomic<int64_t> run_id{0};        // execution of the current call (published by push)
  std::atomic<uint64_t> signature{0};    // shape/format of the current call
  std::vector<uint8_t> reduced;   // the owner's quantized segment sum (rank-local)
};

class Workspace {
 public:
  Workspace(int64_t site, std::vector<int32_t> ordinals)
      : site_(site),
        ordinals_(std::move(ordinals)),
        num_ranks_(static_cast<int>(ordinals_.size())),
        flags_(new Flag[num_ranks_]),
        ranks_(new RankState[num_ranks_]),
        push_slots_(static_cast<size_t>(num_ranks_) * num_ranks_),
        gather_slots_(static_cast<size_t>(num_ranks_) * num_ranks_) {}

  int num_ranks() const { return num_ranks_; }
  int64_t site() const { return site_; }
  int32_t ordinal(int rank) const { return ordinals_[rank]; }
  const std::vector<int32_t>& ordinals() const { return ordinals_; }
  std::atomic<int64_t>& flag(int rank) { return flags_[rank].value; }
  RankState& rank_state(int rank) { return ranks_[rank]; }
  // Receive slot `src` of owner `owner`: written by src in push, read by owner in reduce.
  std::vector<uint8_t>& push_slot(int owner, int src) {
    return push_slots_[static_cast<size_t>(owner) * num_ranks_ + src];
  }
  // Gather slot `owner` of rank `dst`: written by owner in gather, read by dst in tail.
  std::vector<uint8_t>& gather_slot(int dst, int owner) {
    return gather_slots_[static_cast<size_t>(dst) * num_ranks_ + owner];
  }

  // The poison word: false until the group fails, then true for the life of the workspace.
  // Written once, under error_mu_, after the reason (release); a waiting rank polls it (acquire)
  // and then reads the reason under error_mu_. The first failure wins.
  bool broken() const { return broken_.load(std::memory_order_acquire); }
  // A protocol failure seen by a rank waiting for its peers (timeout, disagreeing peers).
  void MarkBroken(const std::string& why) { Break(-1, why); }
  // Rank `rank` failed for a reason of its own; `why` names it and its original cause.
  void Poison(int rank, const std::string& why) { Break(rank, why); }
  std::string BrokenReason() {
    std::lock_guard<std::mutex> lock(error_mu_);
    return error_;
  }
  // The rank that poisoned the workspace, -1 for a protocol failure (or none).
  int FailedRank() {
    std::lock_guard<std::mutex> lock(error_mu_);
    return failed_rank_;
  }

 private:
  const int64_t site_;
  const std::vector<int32_t> ordinals_;
  const int num_ranks_;
  std::unique_ptr<Flag[]> flags_;
  std::unique_ptr<RankState[]> ranks_;
  std::vector<std::vector<uint8_t>> push_slots_;
  std::vector<std::vector<uint8_t>> gather_slots_;
  void Break(int rank, const std::string& why) {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (!broken_.load(std::memory_order_relaxed)) {
      error_ = why;
      failed_rank_ = rank;
      broken_.store(true, std::memory_order_release);
    }
  }

  std::atomic<bool> broken_{false};
  std::mutex error_mu_;
  std::string error_;     // guarded by error_mu_
  int failed_rank_ = -1;  // guarded by error_mu_
};

// What a rank records when it fails for a reason it knows: its error, without the handler
// prefix, after its place in the group. Peers fail with this text.
std::string PoisonText(int rank, int32_t group, int num_ranks, int64_t site, int32_t ordinal,
                       const std::string& error) {
  std::string cause = error;
  const std::string prefix = StrCat("echo_jax ", kWhere, ": ");
  if (cause.compare(0, prefix.size(), prefix) == 0) cause.erase(0, prefix.size());
  return StrCat("rank ", rank, " of the group failed (group ", group, ", P=", num_ranks,
                ", call site ", site, ", device ", ordinal, "): ", cause);
}

// The error of rank `me` that gives up in `stage` because its workspace is broken.
Error_Type PeerFailed(Workspace& ws, int me, int32_t group, const char* stage) {
  if (ws.FailedRank() >= 0) {
    return Aborted(kWhere, "rank ", me, " of group ", group, " gave up in stage '", stage,
                   "': ", ws.BrokenReason());
  }
  return Aborted(kWhere, "rank ", me, " of group ", group, " gave up in stage '", stage,
                 "' because a peer failed: ", ws.BrokenReason());
}

std::string OrdinalList(const std::vector<int32_t>& ordinals) {
  std::string s = "[";
  for (size_t i = 0; i < ordinals.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(ordinals[i]);
  }
  return s + "]";
}

// -------------------------------------------------------------------------------------------
// Process-wide registry: joins in flight, persistent workspaces, per-device bindings.
// -------------------------------------------------------------------------------------------

class Registry {
 public:
  // The workspace of this rank's group at this call site in this execution (see "Which ranks
  // meet" in echo_allreduce_cpu.cc). Blocks until all P ranks have arrived or the deadline
  // passes.
  ffi::ErrorOr<std::shared_ptr<Workspace>> Join(const CallConfig& cfg, const Coords& c) {
    std::unique_lock<std::mutex> lock(mu_);
    const auto bkey = std::make_pair(c.ordinal, cfg.site);
    auto cached = bindings_.find(bkey);
    if (cached != bindings_.end() && cached->second.run_id == c.run_id) {
      Binding& b = cached->second;
      b.last_use = ++tick_;
      if (b.rank != c.rank || b.group != c.group ||
          b.ws->num_ranks() != cfg.num_ranks) {
        Error_Type err = InvalidArgument(
            kWhere, "device ", c.ordinal, " reached call site ", cfg.site,
            " twice in one execution as (rank ", b.rank, ", group ", b.group, ", P=",
            b.ws->num_ranks(), ") and as (rank ", c.rank, ", group ", c.group, ", P=",
            cfg.num_ranks, "): every mesh axis of size > 1 must be manual in the shard_map");
        // The group it joined first waits for this device: tell it.
        b.ws->Poison(b.rank, PoisonText(b.rank, b.group, b.ws->num_ranks(), cfg.site, c.ordinal,
                                        err.message()));
        ForgetLocked(b.ws);
        return err;
      }
      return b.ws;
    }
    const JoinKey key{c.run_id, cfg.site, c.group, cfg.num_ranks};
    std::shared_ptr<JoinEntry>& slot = joins_[key];
    if (!slot) slot = std::make_shared<JoinEntry>(cfg.num_ranks);
    std::shared_ptr<JoinEntry> entry = slot;
    int32_t& mine = entry->ordinals[c.rank];
    if (mine == -1) {
      mine = c.ordinal;
      ++entry->arrived;
    } else if (mine != c.ordinal) {
      Error_Type err = InvalidArgument(
          kWhere, "rank ", c.rank, " of group ", c.group, " (P=", cfg.num_ranks, ", site ",
          cfg.site, ") was claimed by devices ", mine, " and ", c.ordinal,
          " in one execution: the custom call was replicated over a mesh axis that is not manual "
          "(use jax.shard_map over every mesh axis of size > 1, or transport='xla')");
      PoisonEntryLocked(key, entry, c.rank,
                        PoisonText(c.rank, c.group, cfg.num_ranks, cfg.site, c.ordinal,
                                   err.message()));
      return err;
    }
    if (entry->arrived == cfg.num_ranks && !entry->ws && entry->error.empty()) {
      Complete(key, *entry, cfg, c.run_id);
    }
    const auto deadline = Clock::now() + std::chrono::milliseconds(cfg.timeout_ms);
    while (!entry->ws && entry->error.empty()) {
      if (entry->cv.wait_until(lock, deadline) == std::cv_status::timeout && !entry->ws &&
          entry->error.empty()) {
        std::vector<int> missing;
        for (int r = 0; r < cfg.num_ranks; ++r) {
          if (entry->ordinals[r] == -1) missing.push_back(r);
        }
        // Withdraw, so that a later retry of this execution starts clean.
        if (entry->ordinals[c.rank] == c.ordinal) {
          entry->ordinals[c.rank] = -1;
          --entry->arrived;
        }
        if (entry->arrived == 0) {
          auto it = joins_.find(key);
          if (it != joins_.end() && it->second == entry) joins_.erase(it);
        }
        std::string list;
        for (size_t i = 0; i < missing.size(); ++i) {
          list += (i ? ", " : "") + std::to_string(missing[i]);
        }
        return DeadlineExceeded(
            kWhere, "timed out after ", cfg.timeout_ms / 1000.0, " s in stage 'join': rank ",
            c.rank, " of group ", c.group, " (P=", cfg.num_ranks, ", call site ", cfg.site,
            ", device ", c.ordinal, ") waited for rank(s) [", list,
            "] to reach this all-reduce. Every rank of the group must run the same sequence of "
            "echo_psum calls (no rank-dependent control flow around them); the limit is "
            "ECHO_JAX_TIMEOUT_S");
      }
    }
    if (entry->poisoned) {  // a rank of the group failed before it could join: so do we
      if (entry->ordinals[c.rank] == c.ordinal) {
        entry->ordinals[c.rank] = -1;
        --entry->arrived;
      }
      Account(key, entry, c.rank);
      return Aborted(kWhere, "rank ", c.rank, " of group ", c.group, " gave up in stage 'join': ",
                     entry->error);
    }
    if (!entry->error.empty()) return InvalidArgument(kWhere, entry->error);
    return entry->ws;
  }

  // Tells the group of rank c.rank at `site` that this rank failed with `error`, a reason of
  // its own, so that its peers fail at once instead of waiting for it until the timeout: through
  // the workspace it is bound to in this execution (peers waiting on flags poll the poison
  // word), or else through the group's join (peers waiting there are woken, later ones fail on
  // arrival). The workspace is dropped from the registry, so the next execution starts afresh.
  void ReportFailure(const Coords& c, int64_t site, int num_ranks, const std::string& error) {
    const std::string why = PoisonText(c.rank, c.group, num_ranks, site, c.ordinal, error);
    std::lock_guard<std::mutex> lock(mu_);
    auto cached = bindings_.find(std::make_pair(c.ordinal, site));
    if (cached != bindings_.end() && cached->second.run_id == c.run_id &&
        cached->second.rank == c.rank && cached->second.group == c.group &&
        cached->second.ws->num_ranks() == num_ranks) {
      cached->second.ws->Poison(c.rank, why);
      ForgetLocked(cached->second.ws);
      return;
    }
    const JoinKey key{c.run_id, site, c.group, num_ranks};
    std::shared_ptr<JoinEntry>& slot = joins_[key];
    if (!slot) slot = std::make_shared<JoinEntry>(num_ranks);
    std::shared_ptr<JoinEntry> entry = slot;
    if (entry->ordinals[c.rank] == c.ordinal) {  // it had arrived: withdraw
      entry->ordinals[c.rank] = -1;
      --entry->arrived;
    }
    PoisonEntryLocked(key, entry, c.rank, why);
  }

  // Drops a broken workspace so that the next execution gets a fresh one.
  void Forget(const std::shared_ptr<Workspace>& ws) {
    std::lock_guard<std::mutex> lock(mu_);
    ForgetLocked(ws);
  }

  void Stats(int64_t* workspaces, int64_t* pending_joins, int64_t* cached_bindings) {
    std::lock_guard<std::mutex> lock(mu_);
    *workspaces = static_cast<int64_t>(workspaces_.size());
    *pending_joins = static_cast<int64_t>(joins_.size());
    *cached_bindings = static_cast<int64_t>(bindings_.size());
  }

  // Forgets every persistent workspace and binding. Only for when no Echo computation is running:
  // a rank of an execution in flight would join again and its group would time out.
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    workspaces_.clear();
    bindings_.clear();
  }

 private:
  struct JoinKey {
    int64_t run_id;
    int64_t site;
    int32_t group;
    int32_t num_ranks;
    bool operator<(const JoinKey& o) const {
      return std::tie(run_id, site, group, num_ranks) <
             std::tie(o.run_id, o.site, o.group, o.num_ranks);
    }
  };
  struct JoinEntry {
    explicit JoinEntry(int num_ranks) : ordinals(num_ranks, -1), accounted(num_ranks, 0) {}
    std::vector<int32_t> ordinals;  // device of each rank, -1 until it arrives
    int arrived = 0;
    std::shared_ptr<Workspace> ws;  // set once all ranks arrived
    std::string error;              // set instead when the ranks do not form a valid group
    bool poisoned = false;          // error is a rank's own failure (ReportFailure)
    std::vector<char> accounted;    // poisoned: ranks that failed or have seen the failure
    int num_accounted = 0;
    std::condition_variable cv;
  };
  struct Binding {
    int64_t run_id;
    int32_t rank;
    int32_t group;
    std::shared_ptr<Workspace> ws;
    uint64_t last_use;
  };
  struct Persistent {
    std::shared_ptr<Workspace> ws;
    uint64_t last_use;
  };

  // With mu_ held: rank `rank` failed (`why`); wakes the ranks waiting in this join. The entry
  // stays until every rank has failed or seen the failure, so that late ones fail on arrival.
  void PoisonEntryLocked(const JoinKey& key, const std::shared_ptr<JoinEntry>& entry, int rank,
                         const std::string& why) {
    if (!entry->poisoned) {
      entry->poisoned = true;
      entry->error = why;
    }
    entry->cv.notify_all();
    Account(key, entry, rank);
  }

  // With mu_ held: `rank` is done with a poisoned join; the last one removes it.
  void Account(const JoinKey& key, const std::shared_ptr<JoinEntry>& entry, int rank) {
    if (!entry->accounted[rank]) {
      entry->accounted[rank] = 1;
      ++entry->num_accounted;
    }
    if (entry->num_accounted == static_cast<int>(entry->accounted.size())) {
      auto it = joins_.find(key);
      if (it != joins_.end() && it->second == entry) joins_.erase(it);
    }
  }

  // With mu_ held: drops a broken workspace from the registry. The bindings to it stay, so that
  // later calls of the same execution fail at once with its reason (a rank that joined again
  // would wait for peers that have stopped); the next execution replaces them.
  void ForgetLocked(const std::shared_ptr<Workspace>& ws) {
    auto it = workspaces_.find(std::make_pair(ws->site(), ws->ordinals()));
    if (it != workspaces_.end() && it->second.ws == ws) workspaces_.erase(it);
  }

  // Called with mu_ held by the last rank to arrive: hands the workspace to all P ranks.
  void Complete(const JoinKey& key, JoinEntry& entry, const CallConfig& cfg, int64_t run_id) {
    std::vector<int32_t> sorted = entry.ordinals;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
      entry.error = StrCat("one device holds several ranks of group ", key.group,
                           " (devices by rank: ", OrdinalList(entry.ordinals),
                           "): every mesh axis of size > 1 must be manual in the shard_map");
    } else {
      auto wkey = std::make_pair(cfg.site, entry.ordinals);
      auto it = workspaces_.find(wkey);
      if (it == workspaces_.end() || it->second.ws->broken()) {
        auto ws = std::make_shared<Workspace>(cfg.site, entry.ordinals);
        it = workspaces_.insert_or_assign(wkey, Persistent{ws, 0}).first;
      }
      it->second.last_use = ++tick_;
      entry.ws = it->second.ws;
      for (int r = 0; r < cfg.num_ranks; ++r) {
        bindings_[std::make_pair(entry.ordinals[r], cfg.site)] =
            Binding{run_id, r, key.group, entry.ws, tick_};
      }
      EvictLeastRecentlyUsed();
    }
    auto jt = joins_.find(key);
    if (jt != joins_.end() && jt->second.get() == &entry) joins_.erase(jt);
    entry.cv.notify_all();
  }

  // Dropping a workspace from the registry is always safe: executions that joined it keep it
  // alive (through their bindings), and a later execution joins a fresh one with all epochs at 0.
  // Bindings are dropped least recently used first once there are very many (thousands of traced
  // call sites); a rank whose binding was dropped in the middle of an execution joins again, and
  // its group then fails with a timeout rather than mixing two workspaces.
  void EvictLeastRecentlyUsed() {
    while (workspaces_.size() > kMaxWorkspaces) {
      auto oldest = workspaces_.begin();
      for (auto it = workspaces_.begin(); it != workspaces_.end(); ++it) {
        if (it->second.last_use < oldest->second.last_use) oldest = it;
      }
      workspaces_.erase(oldest);
    }
    if (bindings_.size() > kMaxCachedBindings) {
      std::vector<uint64_t> uses;
      uses.reserve(bindings_.size());
      for (const auto& b : bindings_) uses.push_back(b.second.last_use);
      const size_t drop = bindings_.size() - kMaxCachedBindings / 2;
      std::nth_element(uses.begin(), uses.begin() + drop, uses.end());
      const uint64_t cutoff = uses[drop];
      for (auto b = bindings_.begin(); b != bindings_.end();) {
        b = b->second.last_use < cutoff ? bindings_.erase(b) : std::next(b);
      }
    }
  }

  std::mutex mu_;
  std::map<JoinKey, std::shared_ptr<JoinEntry>> joins_;
  std::map<std::pair<int64_t, std::vector<int32_t>>, Persistent> workspaces_;
  std::map<std::pair<int32_t, int64_t>, Binding> bindings_;  // (device, site) -> this run's
  uint64_t tick_ = 0;
};

Registry& GetRegistry() {
  static Registry* registry = new Registry();  // never destroyed: handlers may run at exit
  return *registry;
}

}  // namespace
}  // namespace cpu
}  // namespace echo

#endif  // ECHO_JAX_FFI_CPU_WORKSPACE_H_
