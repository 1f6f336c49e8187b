// The suffix drafter of suffix.py in C++: the same trie (SuffixTree), the same own-text scan (TokenScan),
// the same drafts (best_draft, _chain_draft, _tree_draft) with the same tie-breaking and the same float
// arithmetic in the same order, so its drafts equal the Python ones bit for bit; and a whole drafter
// (SuffixDrafter's trees and requests) that extends and drafts a step's batch in one call.
//
// Python's classes are the reference: every function here names the one it mirrors. Build flags keep the
// float arithmetic as written (no contraction to fused multiply-adds, no fast-math). Scratch buffers are
// function statics: every entry point runs with the GIL held, one call at a time.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <queue>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;
using i32 = int32_t;
using i64 = int64_t;

namespace {

bool g_compensated_sum = false;  // Python >= 3.12's sum() of floats is Neumaier-compensated

// sum(probs) as the running Python does it.
double py_sum(const std::vector<double>& v) {
  if (v.empty()) return 0.0;
  double f = v[0];
  if (!g_compensated_sum) {
    for (size_t i = 1; i < v.size(); ++i) f += v[i];
    return f;
  }
  double c = 0.0;
  for (size_t i = 1; i < v.size(); ++i) {
    double x = v[i], t = f + x;
    if (std::fabs(f) >= std::fabs(x))
      c += (f - t) + x;
    else
      c += (x - t) + f;
    f = t;
  }
  if (c != 0.0 && std::isfinite(c)) f += c;
  return f;
}

struct Cfg {
  i64 max_spec_tokens = 16;
  double factor = 1.0, offset = 0.0, min_prob = 0.1;
  bool tree = false;
  i64 max_depth = 64, max_cached_tokens = 1 << 20, max_prompt_tokens = 1 << 17;
};

struct DraftOut {
  std::vector<i32> toks, parents;
  std::vector<double> probs;
  double score = 0.0;
  i64 match_len = 0;
  // Tree drafts: no node left out has a path probability above left_out, but for those at levels from
  // unpushed_level down (the last node's children), which have unpushed_p at most. Chains: 0.
  double left_out = 0.0, unpushed_p = 0.0;
  i64 unpushed_level = 0;
};

// node << 32 | token -> child: open addressing, linear probing, backward-shift deletion.
class ChildMap {
 public:
  ChildMap() { rehash(16); }
  static uint64_t key(i32 node, i32 tok) { return (uint64_t(uint32_t(node)) << 32) | uint32_t(tok); }
  i32 get(uint64_t k) const {
    size_t i = hash(k) & mask_;
    for (;;) {
      const Slot& s = slots_[i];
      if (s.key == k) return s.val;
      if (s.key == kEmpty) return -1;
      i = (i + 1) & mask_;
    }
  }
  void prefetch(uint64_t k) const { __builtin_prefetch(&slots_[hash(k) & mask_]); }
  void set(uint64_t k, i32 v) {
    if ((size_ + 1) * 2 > mask_ + 1) rehash((mask_ + 1) * 2);
    size_t i = hash(k) & mask_;
    while (slots_[i].key != kEmpty && slots_[i].key != k) i = (i + 1) & mask_;
    if (slots_[i].key == kEmpty) {
      slots_[i].key = k;
      ++size_;
    }
    slots_[i].val = v;
  }
  void erase(uint64_t k) {
    size_t i = hash(k) & mask_;
    while (slots_[i].key != k) {
      if (slots_[i].key == kEmpty) return;
      i = (i + 1) & mask_;
    }
    size_t j = i;
    for (;;) {
      j = (j + 1) & mask_;
      if (slots_[j].key == kEmpty) break;
      size_t home = hash(slots_[j].key) & mask_;
      bool stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
      if (!stays) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i].key = kEmpty;
    --size_;
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t(0);
  struct Slot {
    uint64_t key;
    i32 val;
  };
  static uint64_t hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
  }
  void rehash(size_t cap) {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(cap, Slot{kEmpty, -1});
    mask_ = cap - 1;
    size_ = 0;
    for (const Slot& s : old)
      if (s.key != kEmpty) set(s.key, s.val);
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0, size_ = 0;
};

template <class Node>
struct Kid {
  i32 tok;
  i64 count;
  Node child;
};

template <class Node>
struct Match {
  i64 depth, count;
  Node node;
};

// ---- drafting (best_draft, _chain_draft, _tree_draft) over any Ops ---------------------------------

template <class Ops>
void chain_draft(Ops& ops, typename Ops::Node node, i64 limit, double min_prob, DraftOut& d) {
  d.toks.clear();
  d.probs.clear();
  d.parents.clear();
  d.left_out = d.unpushed_p = 0.0;
  d.unpushed_level = 0;
  double p = 1.0;
  typename Ops::KidT kid;
  while (i64(d.toks.size()) < limit) {
    size_t before = d.probs.size();
    node = ops.run(std::move(node), limit - i64(d.toks.size()), p, min_prob, -1.0, d.toks, d.probs);
    if (d.probs.size() > before) p = d.probs.back();
    if (i64(d.toks.size()) >= limit) break;
    if (!ops.best_child(node, kid)) break;
    p *= double(kid.count) / double(ops.count(node));
    if (p < min_prob) break;
    d.toks.push_back(kid.tok);
    d.probs.push_back(p);
    node = std::move(kid.child);
  }
  i32 n = i32(d.toks.size());
  d.parents.resize(n);
  for (i32 i = 0; i < n; ++i) d.parents[i] = i - 1;
  d.score = py_sum(d.probs);
}

struct Chosen {
  double p;
  i64 parent;
  i32 tok;
  i64 key;
};

struct Entry {  // a heap entry: (-path prob, key, parent key, token, node, its level below the draft's root)
  double negp;
  i64 key, parent;
  i32 tok;
  size_t node;
  i64 level;
};
struct EntryAfter {
  bool operator()(const Entry& a, const Entry& b) const {
    return a.negp > b.negp || (a.negp == b.negp && a.key > b.key);
  }
};

struct Item {  // (p, tok, key), sorted as Python sorts the tuples
  double p;
  i32 tok;
  i64 key;
  bool operator<(const Item& o) const {
    if (p != o.p) return p < o.p;
    if (tok != o.tok) return tok < o.tok;
    return key < o.key;
  }
};

template <class Ops>
struct TreeScratch {  // the buffers of tree_draft, kept between calls
  std::vector<typename Ops::Node> nodes;
  std::vector<Entry> heap;
  std::vector<Chosen> chosen;
  std::vector<i32> rt;
  std::vector<double> rp;
  std::vector<typename Ops::KidT> kids;
  std::vector<i64> above;
  std::vector<i32> first_kid, last_kid, next_kid;
  std::vector<Item> items;
  std::vector<std::pair<i32, Item>> stack;
};

template <class Ops>
void tree_draft(Ops& ops, typename Ops::Node node, i64 limit, double min_prob, DraftOut& d) {
  static TreeScratch<Ops> sc;
  d.toks.clear();
  d.probs.clear();
  d.parents.clear();
  d.score = 0.0;
  d.left_out = min_prob;  // (a node at the bound could pass it after rounding)
  d.unpushed_p = 0.0;
  d.unpushed_level = 0;
  auto& nodes = sc.nodes;
  auto& heap = sc.heap;
  auto& chosen = sc.chosen;
  nodes.clear();
  heap.clear();
  chosen.clear();
  const EntryAfter after;
  i64 tie = 0;
  nodes.push_back(std::move(node));
  heap.push_back(Entry{-1.0, tie++, -1, -1, 0, 0});
  const size_t want = size_t(limit) + 1;
  while (!heap.empty() && chosen.size() < want) {
    std::pop_heap(heap.begin(), heap.end(), after);
    Entry e = heap.back();
    heap.pop_back();
    double negp = e.negp;
    i64 key = e.key;
    chosen.push_back(Chosen{-negp, e.parent, e.tok, key});
    double above = heap.empty() ? -1.0 : -heap.front().negp;
    sc.rt.clear();
    sc.rp.clear();
    typename Ops::Node n = ops.run(std::move(nodes[e.node]), i64(want) - i64(chosen.size()), -negp, min_prob, above,
                                   sc.rt, sc.rp);
    for (size_t i = 0; i < sc.rt.size(); ++i) {
      i64 k = tie++;
      chosen.push_back(Chosen{sc.rp[i], key, sc.rt[i], k});
      key = k;
    }
    i64 level = e.level + i64(sc.rt.size());
    if (chosen.size() >= want) {  // (the last node's children are not in the heap)
      d.unpushed_p = chosen.back().p;
      d.unpushed_level = level + 1;
      break;
    }
    if (!sc.rp.empty()) negp = -sc.rp.back();
    i64 total = ops.count(n);
    double min_count = min_prob * double(total) / -negp * (1 - 1e-9);
    auto& kids = sc.kids;
    kids.clear();
    ops.children(n, min_count, kids);
    std::sort(kids.begin(), kids.end(), [](const auto& a, const auto& b) {
      return a.count != b.count ? a.count > b.count : a.tok < b.tok;
    });
    for (auto& k : kids) {
      double p = -negp * double(k.count) / double(total);
      if (p >= min_prob) {
        nodes.push_back(std::move(k.child));
        heap.push_back(Entry{-p, tie++, key, k.tok, nodes.size() - 1, level + 1});
        std::push_heap(heap.begin(), heap.end(), after);
      }
    }
  }
  if (!heap.empty()) d.left_out = std::max(d.left_out, -heap.front().negp);
  if (chosen.empty()) return;
  auto& above = sc.above;
  above.clear();
  for (size_t i = 1; i < chosen.size(); ++i) above.push_back(chosen[i].parent);
  std::sort(above.begin(), above.end());
  bool one_path = std::adjacent_find(above.begin(), above.end()) == above.end();
  if (one_path) {
    i32 n = i32(chosen.size()) - 1;
    for (i32 i = 0; i < n; ++i) {
      d.toks.push_back(chosen[i + 1].tok);
      d.parents.push_back(i - 1);
      d.probs.push_back(chosen[i + 1].p);
    }
    d.score = py_sum(d.probs);
    return;
  }
  // each key's children in the order chosen: linked lists over the chosen nodes
  auto& first_kid = sc.first_kid;
  auto& last_kid = sc.last_kid;
  auto& next_kid = sc.next_kid;
  first_kid.assign(size_t(tie), -1);
  last_kid.assign(size_t(tie), -1);
  next_kid.assign(chosen.size(), -1);
  for (size_t i = 1; i < chosen.size(); ++i) {
    i64 par = chosen[i].parent;
    if (first_kid[par] < 0)
      first_kid[par] = i32(i);
    else
      next_kid[last_kid[par]] = i32(i);
    last_kid[par] = i32(i);
  }
  auto& items = sc.items;
  auto& stack = sc.stack;
  stack.clear();
  auto push_kids = [&](i64 key, i32 parent_idx) {
    items.clear();
    for (i32 c = first_kid[key]; c >= 0; c = next_kid[c]) items.push_back(Item{chosen[c].p, chosen[c].tok, chosen[c].key});
    if (items.size() > 1) std::sort(items.begin(), items.end());
    for (auto& x : items) stack.emplace_back(parent_idx, x);
  };
  push_kids(chosen[0].key, -1);
  while (!stack.empty()) {
    auto [parent_idx, it] = stack.back();
    stack.pop_back();
    i32 idx = i32(d.toks.size());
    d.toks.push_back(it.tok);
    d.parents.push_back(parent_idx);
    d.probs.push_back(it.p);
    push_kids(it.key, idx);
  }
  d.score = py_sum(d.probs);
}

template <class Ops>
void draft_from(Ops& ops, const Match<typename Ops::Node>& m, i64 limit, const Cfg& cfg, DraftOut& out) {
  if (cfg.tree)
    tree_draft(ops, m.node, limit, cfg.min_prob, out);
  else
    chain_draft(ops, m.node, limit, cfg.min_prob, out);
  out.match_len = m.depth;
}

// Matches i..k (k > i) have the same occurrences (the same count) and token limit, and all but k lack
// the room to draft that many tokens under the depth bound (the first k - i are cut by it). Their drafts
// are the draft of k restricted to fewer levels, so `_best_draft` ends the run with its deepest match
// whose draft scores the most. Where the draft of k (`top`) bounds each deeper match's score strictly
// below its own, that is k: true, and each deeper match's draft is never built. A deeper match keeps
// the nodes of `top` within its room at most, plus as many other nodes as `top` has below it, none of
// a path probability above `top.left_out` (chains: the same path, cut, so none). The margin covers the
// rounding of path probabilities that a shorter run of one-child steps multiplies in another order.
template <class Ops>
bool deeper_lose(const std::vector<Match<typename Ops::Node>>& matches, size_t i, size_t k, i64 limit,
                 i64 max_depth, const DraftOut& top) {
  static std::vector<i32> level;
  static std::vector<double> sum_to;  // sum_to[r]: the path probabilities of top's nodes at levels <= r
  static std::vector<i64> count_to;
  size_t n = top.toks.size();
  level.resize(n);
  sum_to.assign(size_t(limit) + 1, 0.0);
  count_to.assign(size_t(limit) + 1, 0);
  for (size_t j = 0; j < n; ++j) {
    level[j] = top.parents[j] < 0 ? 1 : level[size_t(top.parents[j])] + 1;  // (at most n <= limit)
    sum_to[size_t(level[j])] += top.probs[j];
    count_to[size_t(level[j])] += 1;
  }
  for (size_t r = 1; r <= size_t(limit); ++r) {
    sum_to[r] += sum_to[r - 1];
    count_to[r] += count_to[r - 1];
  }
  for (size_t j = i; j < k; ++j) {
    i64 room = std::max<i64>(0, std::min(limit, max_depth - matches[j].depth));
    double out = room >= top.unpushed_level ? std::max(top.left_out, top.unpushed_p) : top.left_out;
    double most = sum_to[size_t(room)] + double(limit - count_to[size_t(room)]) * out;
    if (!(most * (1 + 1e-9) < top.score)) return false;
  }
  return true;
}

template <class Ops>
DraftOut best_draft(std::vector<Match<typename Ops::Node>>& matches, Ops& ops, i64 max_tokens, const Cfg& cfg,
                    i64 max_depth, double floor) {
  DraftOut best, cur;
  double score = floor;
  i64 last_count = -1;
  bool last_room = true;
  double factor = cfg.factor, offset = cfg.offset + 1e-6;
  auto limit_of = [&](i64 depth) {
    double raw = double(depth) * factor;
    raw = raw + offset;
    return std::min(max_tokens, i64(raw));
  };
  size_t linear_to = 0;  // matches before it are drafted one by one (their run's bound did not hold)
  for (size_t i = 0; i < matches.size(); ++i) {
    auto& m = matches[i];
    if (m.count == last_count && last_room) continue;
    i64 limit = limit_of(m.depth);
    if (double(limit) <= score) break;
    last_count = m.count;
    last_room = max_depth < 0 || m.depth + limit <= max_depth;
    if (double(limit * ops.going_on(m.node)) <= score * double(m.count)) continue;
    size_t k = i;
    while (!last_room && i >= linear_to && k + 1 < matches.size() && matches[k + 1].count == m.count &&
           limit_of(matches[k + 1].depth) == limit) {
      ++k;
      if (matches[k].depth + limit <= max_depth) break;
    }
    if (k > i) {  // a run of matches cut by the depth bound: the draft of its last first
      draft_from(ops, matches[k], limit, cfg, cur);
      if (cur.score > 0.0 && deeper_lose<Ops>(matches, i, k, limit, max_depth, cur)) {
        i = k;
        last_room = matches[k].depth + limit <= max_depth;
        if (cur.score > score) {
          score = cur.score;
          std::swap(best, cur);
        }
        continue;
      }
      linear_to = k;
    }
    draft_from(ops, m, limit, cfg, cur);
    if (cur.score > score) {
      score = cur.score;
      std::swap(best, cur);
    }
  }
  return best;
}

// ---- the trie (SuffixTree, _TrieOps) ----------------------------------------------------------------

struct SeqState {
  std::vector<i32> toks;
  std::vector<i32> live{0};
  i32 top = -1;
};

// A node of a draft: a trie node (node >= 0) or, below a leaf, a position in a sequence (node -1: the
// substring toks[end - depth + 1:end + 1]).
struct TNode {
  i32 node = 0;
  i64 depth = 0;
  const std::vector<i32>* toks = nullptr;
  i64 end = 0;
};

class Trie {
 public:
  explicit Trie(i64 max_depth) : max_depth(max_depth) {
    if (max_depth < 1) throw py::value_error("max_depth must be >= 1");
  }

  i64 max_depth;
  i64 num_nodes = 1, num_tokens = 0;

  bool contains(i64 sid) const { return seqs_.count(sid) > 0; }

  void extend(i64 sid, const i32* in, size_t n) {
    auto& up = seqs_[sid];
    if (!up) up = std::make_unique<SeqState>();
    SeqState* s = up.get();
    std::vector<i32> live = s->live, nxt;
    static std::vector<i32> kids;
    i32 top = s->top;
    for (size_t i = 0; i < n; ++i) {
      i32 t = in[i];
      s->toks.push_back(t);
      i64 end = i64(s->toks.size()) - 1;
      nd_[0].count += 1;
      nxt.clear();
      nxt.push_back(0);
      i32 below = 0;
      top = -1;
      // The lookups below are independent of each other until one adds a node: look them all up first
      // (their memory fetched together, not one miss after another), then again for real.
      // The children found stay valid until a node changes: `grow` adds one (`leaf` ends the walk).
      for (i32 node : live) child_.prefetch(ChildMap::key(node, t));
      kids.clear();
      for (i32 node : live) {
        i32 c = get(node, t);
        kids.push_back(c);
        if (c < 0) break;
        __builtin_prefetch(&nd_[c]);
      }
      bool found = true;
      for (size_t d = 0; d < live.size(); ++d) {
        i32 node = live[d];
        i32 child = found ? kids[d] : get(node, t);
        if (child < 0) {
          for (size_t e = d; e < live.size(); ++e) leaf(live[e], t, s, end - nd_[live[e]].depth);
          break;
        }
        nd_[child].count += 1;
        i32& best = nd_[node].best;  // counts only go up here: the child is the best or as it was
        if (best >= 0 && best != child && beats(child, best)) best = child;
        if (nd_[child].seq) {
          grow(child, below);
          found = false;
        }
        below = child;
        if (nd_[child].depth < max_depth)
          nxt.push_back(child);
        else
          top = child;
      }
      std::swap(live, nxt);
    }
    s->live = std::move(live);
    s->top = top;
    num_tokens += i64(n);
  }

  void remove(i64 sid) {
    auto it = seqs_.find(sid);
    if (it == seqs_.end()) return;
    std::unique_ptr<SeqState> s = std::move(it->second);
    seqs_.erase(it);
    const auto& toks = s->toks;
    i64 len = i64(toks.size());
    nd_[0].count -= len;
    num_tokens -= len;
    for (i64 i = 0; i < len; ++i) {
      i32 node = 0;
      i64 stop = std::min(len, i + max_depth);
      for (i64 j = i; j < stop; ++j) {
        i32 child = get(node, toks[j]);
        if (child < 0) throw std::logic_error("suffix trie: a removed sequence's substring is missing");
        nd_[child].count -= 1;
        if (nd_[node].best == child) nd_[node].best = -2;  // (another child may be the best now)
        if (nd_[child].count == 0) {
          drop(node, child);
          break;
        }
        node = child;
      }
    }
  }

  // match(): the nodes of the pattern's suffixes that occur, longest first.
  void match(const i32* pat, size_t p0, std::vector<Match<TNode>>& out) const {
    size_t p = std::min<size_t>(p0, size_t(max_depth));
    const i32* pt = pat + (p0 - p);
    i32 node = longest_inner(pt, p);
    i64 k = nd_[node].depth;
    if (k < i64(p)) {
      TNode at;
      if (find(pt + (p - k - 1), size_t(k + 1), at) == 2) {
        const auto& toks = *at.toks;
        i64 end = at.end;
        k = at.depth;
        i64 lo = k;
        while (k < i64(p) && end - k >= 0 && toks[end - k] == pt[p - k - 1]) ++k;
        for (i64 j = k; j >= lo; --j) out.push_back(Match<TNode>{j, 1, TNode{-1, j, at.toks, end}});
      }
    }
    while (node) {
      out.push_back(inner(node));
      node = nd_[node].link;
    }
  }

  // match_own(): match() without walking the pattern when it ends with the sequence's own end.
  void match_own(i64 sid, const i32* pat, size_t p0, std::vector<Match<TNode>>& out) const {
    auto it = seqs_.find(sid);
    const SeqState* s = it == seqs_.end() ? nullptr : it->second.get();
    size_t p = std::min<size_t>(p0, size_t(max_depth));
    const i32* pt = pat + (p0 - p);
    size_t r = std::min<size_t>(s ? s->toks.size() : 0, size_t(max_depth));
    if (!(0 < r && r <= p) || !std::equal(pt + (p - r), pt + p, s->toks.end() - i64(r))) return match(pat, p0, out);
    TNode at;
    if (r < p && find(pt + (p - r - 1), r + 1, at) != 0) return match(pat, p0, out);
    if (s->top >= 0) out.push_back(inner(s->top));
    for (size_t i = s->live.size(); i-- > 1;) out.push_back(inner(s->live[i]));
  }

  DraftOut draft(const i32* pat, size_t p, i64 max_tokens, const Cfg& cfg, std::optional<i64> sid, double floor);

  // ---- _TrieOps ----
  using Node = TNode;
  using KidT = Kid<TNode>;

  i64 count(const TNode& n) const { return n.node < 0 ? 1 : nd_[n.node].count; }

  void children(const TNode& n, double min_count, std::vector<KidT>& out) const {
    const std::vector<i32>* toks;
    i64 end, d;
    if (below(n, toks, end, d)) {
      bool going = d < max_depth && end + 1 < i64(toks->size()) && min_count <= 1;
      if (going) out.push_back(KidT{(*toks)[end + 1], 1, TNode{-1, d + 1, toks, end + 1}});
      return;
    }
    i32 best = best_of(n.node);
    if (best < 0 || double(nd_[best].count) < min_count) return;  // not even the most frequent child
    for (i32 c = nd_[n.node].first; c != -1; c = nd_[c].next)
      if (double(nd_[c].count) >= min_count) out.push_back(KidT{nd_[c].token, nd_[c].count, TNode{c, 0, nullptr, 0}});
  }

  i32 best_of(i32 node) const {  // an inner node's most frequent child (-1: none)
    const NodeRec& r = nd_[node];
    if (r.best == -2) {  // not known: found again
      r.best = r.first;
      for (i32 c = r.first; c != -1; c = nd_[c].next)
        if (beats(c, r.best)) r.best = c;
    }
    return r.best;
  }

  i64 going_on(const TNode& n) const {
    const std::vector<i32>* toks;
    i64 end, d;
    if (below(n, toks, end, d)) return (d < max_depth && end + 1 < i64(toks->size())) ? 1 : 0;
    i64 total = 0, k = 0;
    for (i32 c = nd_[n.node].first; c != -1; c = nd_[c].next) {
      if (++k > 8) return nd_[n.node].count;
      total += nd_[c].count;
    }
    return total;
  }

  bool best_child(const TNode& n, KidT& out) const {
    const std::vector<i32>* toks;
    i64 end, d;
    if (below(n, toks, end, d)) {
      if (d < max_depth && end + 1 < i64(toks->size())) {
        out = KidT{(*toks)[end + 1], 1, TNode{-1, d + 1, toks, end + 1}};
        return true;
      }
      return false;
    }
    i32 best = best_of(n.node);
    if (best < 0) return false;
    out = KidT{nd_[best].token, nd_[best].count, TNode{best, 0, nullptr, 0}};
    return true;
  }

  TNode run(TNode node, i64 n, double p, double min_prob, double above, std::vector<i32>& toks,
            std::vector<double>& probs) const {
    i64 added = 0;
    i64 c0 = count(node);
    while (node.node >= 0 && !nd_[node.node].seq) {
      i32 child = nd_[node.node].first;
      if (added >= n || child == -1 || nd_[child].next != -1) return node;
      double q = p * double(nd_[child].count) / double(c0);
      if (q < min_prob || q <= above) return node;
      toks.push_back(nd_[child].token);
      probs.push_back(q);
      ++added;
      node = TNode{child, 0, nullptr, 0};
    }
    const std::vector<i32>* text = nullptr;
    i64 end = 0, d = 0;
    below(node, text, end, d);
    double q = p * 1.0 / double(c0);
    i64 m = std::min({n - added, max_depth - d, i64(text->size()) - end - 1});
    if (m <= 0 || q < min_prob || q <= above) return node;
    for (i64 i = 1; i <= m; ++i) {
      toks.push_back((*text)[end + i]);
      probs.push_back(q);
    }
    return TNode{-1, d + m, text, end + m};
  }

 private:
  struct NodeRec {  // a node: its count, a leaf's occurrence (start, seq; seq nullptr: inner), depth, suffix
    i64 count;      // link, children (first, next: a linked list), token, and its most frequent child (best:
    i64 start;      // -1 none, -2 not known since a count went down)
    SeqState* seq;
    i32 depth, link, first, next, token;
    mutable i32 best;
  };
  std::vector<NodeRec> nd_{NodeRec{0, 0, nullptr, 0, 0, -1, -1, -1, -1}};
  std::vector<i32> free_;
  ChildMap child_;
  std::unordered_map<i64, std::unique_ptr<SeqState>> seqs_;

  i32 get(i32 node, i32 t) const { return child_.get(ChildMap::key(node, t)); }

  Match<TNode> inner(i32 node) const { return Match<TNode>{nd_[node].depth, nd_[node].count, TNode{node, 0, nullptr, 0}}; }

  bool below(const TNode& n, const std::vector<i32>*& toks, i64& end, i64& d) const {
    if (n.node < 0) {
      toks = n.toks;
      end = n.end;
      d = n.depth;
      return true;
    }
    SeqState* s = nd_[n.node].seq;
    if (!s) return false;
    toks = &s->toks;
    d = nd_[n.node].depth;
    end = nd_[n.node].start + d - 1;
    return true;
  }

  void leaf(i32 parent, i32 t, SeqState* s, i64 start) {
    NodeRec r{1, start, s, nd_[parent].depth + 1, -1, -1, nd_[parent].first, t, -1};
    i32 x;
    if (!free_.empty()) {
      x = free_.back();
      free_.pop_back();
      nd_[x] = r;
    } else {
      x = i32(nd_.size());
      nd_.push_back(r);
    }
    NodeRec& p = nd_[parent];
    p.first = x;
    if (p.best == -1 || (p.best >= 0 && beats(x, p.best))) p.best = x;  // (-2: not known, found when asked)
    child_.set(ChildMap::key(parent, t), x);
    ++num_nodes;
  }

  bool beats(i32 a, i32 b) const {  // the more frequent child; ties: the smaller token
    return nd_[a].count > nd_[b].count || (nd_[a].count == nd_[b].count && nd_[a].token < nd_[b].token);
  }

  void grow(i32 x, i32 link) {
    SeqState* s = nd_[x].seq;
    i64 start = nd_[x].start, d = nd_[x].depth;
    nd_[x].seq = nullptr;
    nd_[x].link = link;
    const auto& toks = s->toks;
    if (start + d < i64(toks.size())) {
      if (d < max_depth) leaf(x, toks[start + d], s, start);
    } else if (d < max_depth) {
      s->live.push_back(x);
    } else {
      s->top = x;
    }
  }

  void drop(i32 parent, i32 node) {
    if (nd_[parent].first == node) {
      nd_[parent].first = nd_[node].next;
    } else {
      i32 x = nd_[parent].first;
      while (nd_[x].next != node) x = nd_[x].next;
      nd_[x].next = nd_[node].next;
    }
    std::vector<std::pair<i32, i32>> stack{{parent, node}};
    while (!stack.empty()) {
      auto [p, x] = stack.back();
      stack.pop_back();
      child_.erase(ChildMap::key(p, nd_[x].token));
      nd_[x].seq = nullptr;
      free_.push_back(x);
      --num_nodes;
      for (i32 c = nd_[x].first; c != -1; c = nd_[c].next) stack.emplace_back(x, c);
    }
  }

  // _find(): 0 (it does not occur), 1 (an inner node: out.node) or 2 (below a leaf: out).
  int find(const i32* tk, size_t len, TNode& out) const {
    i32 node = 0;
    for (size_t j = 0; j < len; ++j) {
      node = get(node, tk[j]);
      if (node < 0) return 0;
      if (SeqState* s = nd_[node].seq) {
        const auto& toks = s->toks;
        i64 start = nd_[node].start, d = nd_[node].depth, rest = i64(len - j - 1);
        if (d + rest > max_depth || start + d + rest > i64(toks.size())) return 0;
        for (i64 i = 0; i < rest; ++i)
          if (toks[start + d + i] != tk[j + 1 + i]) return 0;
        out = TNode{-1, d + rest, &toks, start + d + rest - 1};
        return 2;
      }
    }
    out = TNode{node, 0, nullptr, 0};
    return 1;
  }

  // _longest_inner()
  i32 longest_inner(const i32* pt, size_t p) const {
    i32 node = 0;
    size_t shortn = std::min<size_t>({p, 8, size_t(std::max<i64>(max_depth - 1, 0))});
    for (size_t k = 1; k <= shortn; ++k) {
      i32 x = 0;
      for (size_t j = p - k; j < p; ++j) {
        x = get(x, pt[j]);
        if (x < 0 || nd_[x].seq) return node;
      }
      node = x;
    }
    if (shortn == p) return node;
    node = 0;
    for (size_t j = 0; j < p; ++j) {
      i32 t = pt[j];
      for (;;) {
        i32 x = nd_[node].depth < max_depth ? get(node, t) : -1;
        if (x >= 0 && !nd_[x].seq) {
          node = x;
          break;
        }
        if (!node) break;
        node = nd_[node].link;
      }
    }
    return node;
  }
};

DraftOut Trie::draft(const i32* pat, size_t p, i64 max_tokens, const Cfg& cfg, std::optional<i64> sid,
                     double floor) {
  static std::vector<Match<TNode>> matches;
  matches.clear();
  if (sid)
    match_own(*sid, pat, p, matches);
  else
    match(pat, p, matches);
  return best_draft(matches, *this, max_tokens, cfg, max_depth, floor);
}

// ---- the own-text scan (TokenScan, _ScanOps) --------------------------------------------------------

class Scan {
 public:
  using Node = std::vector<i32>;  // the sorted end positions of a matched substring's occurrences
  using KidT = Kid<Node>;

  explicit Scan(i64 max_depth) : max_depth(max_depth) {
    if (max_depth < 1) throw py::value_error("max_depth must be >= 1");
  }
  i64 max_depth;

  void extend(const i32* in, size_t k) {
    for (size_t i = 0; i < k; ++i) {
      pos_[in[i]].push_back(i32(text_.size()));
      text_.push_back(in[i]);
    }
  }
  size_t size() const { return text_.size(); }

  // _levels(): (match length, count, end positions), longest first.
  void levels(const i32* pat, size_t p0, std::vector<Match<Node>>& out) const {
    size_t p = std::min<size_t>(p0, size_t(max_depth));
    const i32* pt = pat + (p0 - p);
    i64 n = i64(text_.size());
    if (!p || !n) return;
    static const Node none;
    auto it = pos_.find(pt[p - 1]);
    const Node* ends = it == pos_.end() ? &none : &it->second;  // the occurrences of the last m tokens
    i64 m = 1;
    static std::vector<const Node*> shorter;  // shorter[v - 1]: those of the last v tokens, v < m
    static std::deque<Node> narrowed;  // (a deque: growing it moves none of its lists)
    shorter.clear();
    size_t used = 0;
    if (ends->size() > 16) {
      while (ends->size() > 16 && m < i64(p)) {
        if (narrowed.size() <= used) narrowed.emplace_back();
        Node& nx = narrowed[used++];
        nx.clear();
        i32 want = pt[p - 1 - m];
        for (i32 e : *ends) {
          i64 at = i64(e) - m;
          if ((at >= 0 ? text_[at] : -1) == want) nx.push_back(e);
        }
        shorter.push_back(ends);
        ends = &nx;
        ++m;
      }
    }
    i64 last = -1;
    if (!ends->empty()) {
      static std::vector<i64> lens, vs;
      lens.clear();
      i64 most_so_far = 0;
      for (i32 e : *ends) {
        i64 most = e == n - 1 ? std::min<i64>(i64(p), most_so_far) : i64(p);
        i64 v = std::min(m, most);
        while (v < most && v <= e && text_[e - v] == pt[p - 1 - v]) ++v;
        lens.push_back(v);
        most_so_far = std::max(most_so_far, v);
      }
      vs = lens;
      std::sort(vs.begin(), vs.end(), std::greater<i64>());
      vs.erase(std::unique(vs.begin(), vs.end()), vs.end());
      for (i64 v : vs) {
        if (!v) continue;
        Node level;
        level.reserve(ends->size());
        for (size_t i = 0; i < ends->size(); ++i)
          if (lens[i] >= v) level.push_back((*ends)[i]);
        last = i64(level.size());
        out.push_back(Match<Node>{v, last, std::move(level)});
      }
    }
    for (i64 v = m - 1; v >= 1; --v) {
      if (i64(shorter[v - 1]->size()) != last) {
        last = i64(shorter[v - 1]->size());
        out.push_back(Match<Node>{v, last, *shorter[v - 1]});
      }
    }
  }

  DraftOut draft(const i32* pat, size_t p, i64 max_tokens, const Cfg& cfg, double floor) {
    static std::vector<Match<Node>> matches;
    matches.clear();
    levels(pat, p, matches);
    return best_draft(matches, *this, max_tokens, cfg, -1, floor);
  }

  // ---- _ScanOps ----
  i64 count(const Node& ends) const { return i64(ends.size()); }

  i64 going_on(const Node& ends) const {
    if (ends.empty()) return 0;
    return i64(ends.size()) - (ends.back() == i64(text_.size()) - 1 ? 1 : 0);
  }

  // The next tokens of the occurrences that go on and how often each follows: (token, count), ascending
  // by token (the order does not matter to the callers: best_child breaks ties by token, children's
  // caller sorts).
  void follow_counts(const Node& ends, std::vector<std::pair<i32, i64>>& counts) const {
    static std::vector<i32> next;
    size_t k = going(ends);
    next.resize(k);
    for (size_t i = 0; i < k; ++i) next[i] = text_[ends[i] + 1];
    std::sort(next.begin(), next.end());
    counts.clear();
    for (size_t i = 0; i < k;) {
      size_t j = i;
      while (j < k && next[j] == next[i]) ++j;
      counts.emplace_back(next[i], i64(j - i));
      i = j;
    }
  }

  Node child_of(const Node& ends, i32 tok, i64 count) const {
    Node c;
    c.reserve(size_t(count));
    size_t k = going(ends);
    for (size_t i = 0; i < k; ++i)
      if (text_[ends[i] + 1] == tok) c.push_back(ends[i] + 1);
    return c;
  }

  void children(const Node& ends, double min_count, std::vector<KidT>& out) const {
    static std::vector<std::pair<i32, i64>> counts;
    follow_counts(ends, counts);
    for (auto [t, c] : counts)
      if (double(c) >= min_count) out.push_back(KidT{t, c, child_of(ends, t, c)});
  }

  bool best_child(const Node& ends, KidT& out) const {
    static std::vector<std::pair<i32, i64>> counts;
    follow_counts(ends, counts);
    if (counts.empty()) return false;
    size_t b = 0;
    for (size_t j = 1; j < counts.size(); ++j)
      if (counts[j].second > counts[b].second) b = j;  // (ascending tokens: ties keep the smaller)
    out = KidT{counts[b].first, counts[b].second, child_of(ends, counts[b].first, counts[b].second)};
    return true;
  }

  Node run(Node ends, i64 n, double p, double min_prob, double above, std::vector<i32>& toks,
           std::vector<double>& probs) const {
    i64 k0 = i64(ends.size());
    i64 len = i64(text_.size());
    if (k0 == 1) {
      if (p < min_prob || p <= above) return ends;
      i64 e = ends[0];
      i64 m = std::max<i64>(0, std::min(n, len - e - 1));
      for (i64 i = 1; i <= m; ++i) {
        toks.push_back(text_[e + i]);
        probs.push_back(p);
      }
      return Node{i32(e + m)};
    }
    i64 added = 0;
    Node nxt;
    while (added < n) {
      size_t k = going(ends);
      if (!k) break;
      nxt.assign(ends.begin(), ends.begin() + k);
      for (auto& e : nxt) e += 1;
      i32 t = text_[nxt[0]];
      double q = p * double(nxt.size()) / double(k0);
      if (q < min_prob || q <= above) break;
      bool same = true;
      for (i32 e : nxt)
        if (text_[e] != t) {
          same = false;
          break;
        }
      if (!same) break;
      toks.push_back(t);
      probs.push_back(q);
      ++added;
      std::swap(ends, nxt);
    }
    return ends;
  }

 private:
  std::vector<i32> text_;
  std::unordered_map<i32, std::vector<i32>> pos_;  // token -> where it occurs, ascending

  size_t going(const Node& ends) const {  // the occurrences with a next token (all but one at the text's end)
    if (ends.empty()) return 0;
    return ends.size() - (ends.back() == i64(text_.size()) - 1 ? 1 : 0);
  }
};

// ---- a whole drafter (SuffixDrafter's trees and requests) ----------------------------------------------

struct Req {
  i32 tenant;
  std::unique_ptr<Scan> scan;
  std::vector<i32> tail;
};

class Drafter {
 public:
  explicit Drafter(Cfg cfg) : cfg(cfg) {
    if (cfg.max_depth < 1) throw py::value_error("max_depth must be >= 1");
  }
  Cfg cfg;

  i32 add_tenant() {
    trees_.push_back(std::make_unique<Trie>(cfg.max_depth));
    return i32(trees_.size()) - 1;
  }

  void start(i64 slot, i32 tenant, const std::vector<i32>& prompt) {
    if (tenant < 0 || size_t(tenant) >= trees_.size()) throw py::index_error("no such tenant tree");
    Req r;
    r.tenant = tenant;
    r.scan = std::make_unique<Scan>(cfg.max_depth);
    size_t k = std::min<size_t>(prompt.size(), size_t(cfg.max_prompt_tokens));
    r.scan->extend(prompt.data() + (prompt.size() - k), k);
    size_t t = std::min<size_t>(prompt.size(), size_t(cfg.max_depth));
    r.tail.assign(prompt.end() - i64(t), prompt.end());
    reqs_[slot] = std::move(r);
  }

  void extend(i64 slot, const i32* toks, size_t k) {
    auto it = reqs_.find(slot);
    if (it == reqs_.end()) throw py::key_error("no such request slot");
    Req& r = it->second;
    r.scan->extend(toks, k);
    trees_[r.tenant]->extend(slot, toks, k);
    r.tail.insert(r.tail.end(), toks, toks + k);
    if (i64(r.tail.size()) > cfg.max_depth) r.tail.erase(r.tail.begin(), r.tail.end() - cfg.max_depth);
  }

  void end(i64 slot) { reqs_.erase(slot); }
  Trie& tree(i32 tenant) { return *trees_.at(size_t(tenant)); }
  i64 num_tokens() const {
    i64 n = 0;
    for (auto& t : trees_) n += t->num_tokens;
    return n;
  }

  DraftOut draft_one(i64 slot, i64 limit) {
    limit = std::min(limit, cfg.max_spec_tokens);
    if (limit < 1) return DraftOut{};
    auto it = reqs_.find(slot);
    if (it == reqs_.end()) throw py::key_error("no such request slot");
    Req& r = it->second;
    DraftOut glob = trees_[r.tenant]->draft(r.tail.data(), r.tail.size(), limit, cfg, slot, 0.0);
    DraftOut own = r.scan->draft(r.tail.data(), r.tail.size(), limit, cfg, glob.score != 0.0 ? glob.score - 1e-9 : 0.0);
    return glob.score > own.score ? std::move(glob) : std::move(own);
  }

 private:
  std::vector<std::unique_ptr<Trie>> trees_;
  std::unordered_map<i64, Req> reqs_;
};

std::vector<i32> to_i32(py::handle seq) {
  py::array_t<i32, py::array::c_style | py::array::forcecast> a = py::array_t<i32, py::array::c_style | py::array::forcecast>::ensure(seq);
  if (!a) throw py::type_error("expected a sequence of token ids");
  if (a.ndim() != 1) {
    if (a.size() == 0) return {};
    throw py::value_error("expected a flat sequence of token ids");
  }
  return std::vector<i32>(a.data(), a.data() + a.size());
}

// Token ids from a list, tuple or array: a short list or tuple without numpy's per-call cost.
std::vector<i32> tokens(py::handle seq) {
  // Only exact ints (no __index__ can run Python code and change the list while it is read), each in
  // int32's range as the numpy path requires.
  if (PyList_Check(seq.ptr()) || PyTuple_Check(seq.ptr())) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
    if (n <= 64) {
      std::vector<i32> out(static_cast<size_t>(n));
      PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
      bool exact = true;
      for (Py_ssize_t i = 0; i < n && exact; ++i) exact = PyLong_CheckExact(items[i]);
      if (exact) {
        for (Py_ssize_t i = 0; i < n; ++i) {
          long long v = PyLong_AsLongLong(items[i]);
          if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
          if (v < INT32_MIN || v > INT32_MAX) throw py::value_error("token id out of int32 range");
          out[size_t(i)] = i32(v);
        }
        return out;
      }
    }
  }
  return to_i32(seq);
}

py::tuple as_python(const DraftOut& d) {
  size_t n = d.toks.size();
  py::array_t<i32> toks(n), parents(n);
  py::array_t<float> probs(n);
  std::copy(d.toks.begin(), d.toks.end(), toks.mutable_data());
  std::copy(d.parents.begin(), d.parents.end(), parents.mutable_data());
  float* pp = probs.mutable_data();
  for (size_t i = 0; i < n; ++i) pp[i] = float(d.probs[i]);
  return py::make_tuple(toks, parents, probs, d.score, d.match_len);
}

Cfg make_cfg(i64 max_spec_tokens, double factor, double offset, double min_prob, bool tree, i64 max_depth,
             i64 max_cached_tokens, i64 max_prompt_tokens) {
  Cfg c;
  c.max_spec_tokens = max_spec_tokens;
  c.factor = factor;
  c.offset = offset;
  c.min_prob = min_prob;
  c.tree = tree;
  c.max_depth = max_depth;
  c.max_cached_tokens = max_cached_tokens;
  c.max_prompt_tokens = max_prompt_tokens;
  return c;
}

}  // namespace

PYBIND11_MODULE(_suffix_native, m) {
  m.doc() = "The suffix drafter of talaria_jax.engine.spec.suffix, compiled: the same drafts.";
  m.def("set_compensated_sum", [](bool on) { g_compensated_sum = on; },
        "Scores as Python >= 3.12's sum() adds floats (Neumaier-compensated), else left to right.");
  m.def("sum_floats", [](const std::vector<double>& v) { return py_sum(v); },
        "sum(v) as the drafts' scores are added (to check it against this Python's sum()).");

  py::class_<Trie>(m, "Tree", "SuffixTree with integer sequence ids.")
      .def(py::init<i64>(), py::arg("max_depth") = 64)
      .def_readonly("max_depth", &Trie::max_depth)
      .def_readonly("num_nodes", &Trie::num_nodes)
      .def_readonly("num_tokens", &Trie::num_tokens)
      .def("__contains__", &Trie::contains)
      .def("extend", [](Trie& t, i64 sid, py::handle toks) {
        auto v = tokens(toks);
        t.extend(sid, v.data(), v.size());
      })
      .def("remove", &Trie::remove)
      .def("match", [](Trie& t, py::handle pattern) {
        auto v = tokens(pattern);
        std::vector<Match<TNode>> ms;
        t.match(v.data(), v.size(), ms);
        py::list out;
        for (auto& x : ms) out.append(py::make_tuple(x.depth, x.count));
        return out;
      }, "(match length, count) of the pattern's matched suffixes, longest first.")
      .def("draft", [](Trie& t, py::handle pattern, i64 max_tokens, i64 max_spec_tokens, double factor, double offset,
                       double min_prob, bool tree, std::optional<i64> seq_id, double floor) {
        auto v = tokens(pattern);
        Cfg c = make_cfg(max_spec_tokens, factor, offset, min_prob, tree, t.max_depth, 0, 0);
        return as_python(t.draft(v.data(), v.size(), max_tokens, c, seq_id, floor));
      }, py::arg("pattern"), py::arg("max_tokens"), py::arg("max_spec_tokens"), py::arg("max_spec_factor"),
         py::arg("max_spec_offset"), py::arg("min_token_prob"), py::arg("tree"), py::arg("seq_id") = py::none(),
         py::arg("floor") = 0.0);

  py::class_<Scan>(m, "Scan", "TokenScan.")
      .def(py::init([](py::handle toks, i64 max_depth) {
        auto s = std::make_unique<Scan>(max_depth);
        auto v = tokens(toks);
        s->extend(v.data(), v.size());
        return s;
      }), py::arg("tokens"), py::arg("max_depth") = 64)
      .def("extend", [](Scan& s, py::handle toks) {
        auto v = tokens(toks);
        s.extend(v.data(), v.size());
      })
      .def("__len__", &Scan::size)
      .def("draft", [](Scan& s, py::handle pattern, i64 max_tokens, i64 max_spec_tokens, double factor, double offset,
                       double min_prob, bool tree, double floor) {
        auto v = tokens(pattern);
        Cfg c = make_cfg(max_spec_tokens, factor, offset, min_prob, tree, s.max_depth, 0, 0);
        return as_python(s.draft(v.data(), v.size(), max_tokens, c, floor));
      }, py::arg("pattern"), py::arg("max_tokens"), py::arg("max_spec_tokens"), py::arg("max_spec_factor"),
         py::arg("max_spec_offset"), py::arg("min_token_prob"), py::arg("tree"), py::arg("floor") = 0.0);

  py::class_<Drafter>(m, "Drafter", "SuffixDrafter's trees and requests; requests and their sequences by slot.")
      .def(py::init([](i64 a, double b, double c, double d, bool e, i64 f, i64 g, i64 h) {
             return std::make_unique<Drafter>(make_cfg(a, b, c, d, e, f, g, h));
           }), py::arg("max_spec_tokens"), py::arg("max_spec_factor"), py::arg("max_spec_offset"),
           py::arg("min_token_prob"), py::arg("tree"), py::arg("max_depth"), py::arg("max_cached_tokens"),
           py::arg("max_prompt_tokens"))
      .def("add_tenant", &Drafter::add_tenant)
      .def("start", [](Drafter& d, i64 slot, i32 tenant, py::handle prompt) { d.start(slot, tenant, to_i32(prompt)); })
      .def("extend", [](Drafter& d, i64 slot, py::handle toks) {
        auto v = tokens(toks);
        d.extend(slot, v.data(), v.size());
      })
      .def("extend_batch", [](Drafter& d, py::array_t<i64, py::array::c_style | py::array::forcecast> slots,
                              py::array_t<i32, py::array::c_style | py::array::forcecast> toks) {
        if (slots.size() != toks.size()) throw py::value_error("one token per slot");
        const i64* s = slots.data();
        const i32* t = toks.data();
        for (py::ssize_t i = 0; i < slots.size(); ++i) d.extend(s[i], t + i, 1);
      }, "Appends one token to each slot's request.")
      .def("end", &Drafter::end)
      .def("contains", [](Drafter& d, i32 tenant, i64 slot) { return d.tree(tenant).contains(slot); })
      .def("remove", [](Drafter& d, i32 tenant, i64 slot) { d.tree(tenant).remove(slot); })
      .def("tree_tokens", [](Drafter& d, i32 tenant) { return d.tree(tenant).num_tokens; })
      .def("num_tokens", &Drafter::num_tokens)
      .def("draft", [](Drafter& d, py::array_t<i64, py::array::c_style | py::array::forcecast> slots,
                       py::array_t<i64, py::array::c_style | py::array::forcecast> limits) {
        if (slots.size() != limits.size()) throw py::value_error("one limit per slot");
        size_t n = size_t(slots.size());
        std::vector<DraftOut> outs(n);
        const i64* s = slots.data();
        const i64* l = limits.data();
        size_t total = 0;
        for (size_t i = 0; i < n; ++i) {
          outs[i] = d.draft_one(s[i], l[i]);
          total += outs[i].toks.size();
        }
        py::array_t<i32> toks(total), parents(total);
        py::array_t<float> probs(total);
        py::array_t<i64> offsets(n + 1), match_len(n);
        py::array_t<double> scores(n);
        i32* tp = toks.mutable_data();
        i32* pp = parents.mutable_data();
        float* qp = probs.mutable_data();
        i64* op = offsets.mutable_data();
        i64* mp = match_len.mutable_data();
        double* sp = scores.mutable_data();
        size_t at = 0;
        for (size_t i = 0; i < n; ++i) {
          op[i] = i64(at);
          const DraftOut& o = outs[i];
          for (size_t j = 0; j < o.toks.size(); ++j, ++at) {
            tp[at] = o.toks[j];
            pp[at] = o.parents[j];
            qp[at] = float(o.probs[j]);
          }
          sp[i] = o.score;
          mp[i] = o.match_len;
        }
        op[n] = i64(at);
        return py::make_tuple(toks, parents, probs, offsets, scores, match_len);
      }, "Drafts for a batch: (tokens, parents, probs) concatenated, offsets [n + 1], scores, match lengths.");
}
