// Group suffix tree: the draft source of Seer's adaptive grouped speculative decoding.
//
// One GroupSuffixTree holds several token sequences (a prompt and the responses of its
// sibling requests).  It is a trie over token ids that contains every substring of
// length <= max_depth of every sequence, with how many times each string occurs (kept
// by the string's parent node, see Node).  Appending one token to a sequence touches at
// most max_depth nodes (the suffixes of that sequence that are still shorter than
// max_depth), so the tree grows online while the siblings decode, with no rebuild.
//
// Drafting: match the longest suffix of a request's context that occurs somewhere
// followed by at least one token, then walk down from that node, either along the
// most frequent child (single path) or best-first by estimated path probability into
// a token tree (multi-path).  The conditional probability of a child c of node v is
// count(c) / child_total(v), where child_total(v) is the number of occurrences of v
// that continue with some token; occurrences that end a sequence (for instance the
// requesting sequence itself, whose end is the context being matched) carry no
// information about the next token and do not dilute the estimate.
//
// Weights: each sequence has a positive integer weight (default 1), and every node
// counts the weighted occurrences of its string: a sequence of weight k counts exactly
// as k copies of it would.  A drafter gives responses of earlier iterations a lower
// weight than live siblings by giving the live ones a larger weight.
//
// Memory: nodes are 12-byte records in fixed-size chunks (growing never copies the
// nodes already there, so an append never stalls on a reallocation of a large tree);
// a node with a single child stores it inline (the common case deep in the trie),
// only nodes with two or more children own a sorted edge list.  Freed nodes and edge
// lists are recycled.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <queue>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace seer {

// A vector of T in chunks of 2^kBits elements: indexing costs a shift and a mask,
// and growth allocates one new chunk instead of moving every element.
template <typename T, int kBits = 12>
class ChunkedVector {
 public:
  size_t size() const { return size_; }
  size_t capacity() const { return chunks_.size() << kBits; }
  T& operator[](size_t i) { return chunks_[i >> kBits][i & kMask]; }
  const T& operator[](size_t i) const { return chunks_[i >> kBits][i & kMask]; }
  void emplace_back() {
    if (size_ == capacity()) chunks_.emplace_back(size_t{1} << kBits);
    (*this)[size_++] = T{};
  }
  void assign(size_t n, const T& value) {
    chunks_.clear();
    size_ = 0;
    for (size_t i = 0; i < n; ++i) {
      emplace_back();
      (*this)[i] = value;
    }
  }

 private:
  static constexpr size_t kMask = (size_t{1} << kBits) - 1;
  std::vector<std::vector<T>> chunks_;
  size_t size_ = 0;
};

// (tokens, parents, path probabilities, match length)
using Draft = std::tuple<std::vector<int32_t>, std::vector<int32_t>, std::vector<double>, int>;

class GroupSuffixTree {
 public:
  explicit GroupSuffixTree(int max_depth) : max_depth_(max_depth) {
    if (max_depth < 2 || max_depth > 4096) {
      throw std::invalid_argument("max_depth must be in [2, 4096], got " +
                                  std::to_string(max_depth));
    }
    nodes_.emplace_back();  // root: the empty string
  }

  int max_depth() const { return max_depth_; }

  // Starts a new sequence of the given weight; it is an error if the key is already present.
  void add_sequence(int64_t key, const std::vector<int32_t>& tokens, int32_t weight) {
    if (seqs_.count(key)) throw py::key_error("sequence " + std::to_string(key) + " exists");
    if (weight < 1 || weight > kMaxWeight) {
      throw std::invalid_argument("weight must be in [1, " + std::to_string(kMaxWeight) + "], got " +
                                  std::to_string(weight));
    }
    check_tokens(tokens, weight);
    Sequence& s = seqs_[key];
    s.weight = weight;
    append_all(s, tokens);
  }

  // Appends tokens to a sequence (creating it with weight 1 if needed): O(max_depth)
  // per token.
  void extend(int64_t key, const std::vector<int32_t>& tokens) {
    auto it = seqs_.find(key);
    check_tokens(tokens, it == seqs_.end() ? 1 : it->second.weight);
    append_all(it == seqs_.end() ? seqs_[key] : it->second, tokens);
  }

  // extend() for a sequence that exists, else add_sequence(key, tokens, weight): one
  // call (one key lookup) for the engine's per-token appends.
  void append(int64_t key, const std::vector<int32_t>& tokens, int32_t weight) {
    auto it = seqs_.find(key);
    if (it == seqs_.end()) {
      add_sequence(key, tokens, weight);
      return;
    }
    check_tokens(tokens, it->second.weight);
    append_all(it->second, tokens);
  }

  // Removes a sequence and every occurrence it contributed; nodes left without
  // occurrences are freed for reuse.  O(len * max_depth).
  void remove_sequence(int64_t key) {
    auto it = seqs_.find(key);
    if (it == seqs_.end()) throw py::key_error("no sequence " + std::to_string(key));
    const std::vector<int32_t>& toks = it->second.tokens;
    const int32_t w = it->second.weight;
    const size_t n = toks.size();
    std::vector<int32_t> dead;
    for (size_t i = 0; i < n; ++i) {
      int32_t node = kRoot;
      const size_t end = std::min(n, i + static_cast<size_t>(max_depth_));
      for (size_t j = i; j < end; ++j) {
        const int32_t parent = node;
        int32_t left;
        node = add_to_child(parent, toks[j], -w, left);
        // Unlink now but keep walking through the node: its own edges stay intact
        // until the walk is over (its descendants on this walk die with it).
        if (left == 0) {
          unlink_child(parent, toks[j]);
          dead.push_back(node);
        }
      }
      for (int32_t d : dead) free_node(d);
      dead.clear();
    }
    num_tokens_ -= static_cast<int64_t>(n);
    seqs_.erase(it);
  }

  bool has_sequence(int64_t key) const { return seqs_.count(key) != 0; }

  int64_t sequence_length(int64_t key) const {
    auto it = seqs_.find(key);
    if (it == seqs_.end()) throw py::key_error("no sequence " + std::to_string(key));
    return static_cast<int64_t>(it->second.tokens.size());
  }

  int32_t sequence_weight(int64_t key) const {
    auto it = seqs_.find(key);
    if (it == seqs_.end()) throw py::key_error("no sequence " + std::to_string(key));
    return it->second.weight;
  }

  std::vector<int64_t> sequence_keys() const {
    std::vector<int64_t> keys;
    keys.reserve(seqs_.size());
    for (const auto& kv : seqs_) keys.push_back(kv.first);
    std::sort(keys.begin(), keys.end());
    return keys;
  }

  // Weighted occurrences of `path` (0 if absent or longer than max_depth); the empty
  // path counts every token.
  int64_t count(const std::vector<int32_t>& path) const {
    if (path.empty()) return nodes_[kRoot].child_total;  // the root's children: every token
    const int32_t parent = walk(path.data(), path.size() - 1);
    return parent < 0 ? 0 : child_count(parent, path.back());
  }

  int64_t num_nodes() const {
    return static_cast<int64_t>(nodes_.size() - free_nodes_.size());
  }
  int64_t num_sequences() const { return static_cast<int64_t>(seqs_.size()); }
  int64_t num_tokens() const { return num_tokens_; }

  // Bytes held by the tree's containers (capacity, not size), for memory accounting.
  int64_t memory_bytes() const {
    size_t bytes = sizeof(*this) + nodes_.capacity() * sizeof(Node) +
                   free_nodes_.capacity() * sizeof(int32_t) +
                   edge_lists_.capacity() * sizeof(std::vector<Edge>) +
                   free_lists_.capacity() * sizeof(int32_t) +
                   root_kids_.capacity() * sizeof(RootKid);
    for (const auto& l : edge_lists_) bytes += l.capacity() * sizeof(Edge);
    for (const auto& kv : seqs_) {
      bytes += sizeof(kv) + kv.second.tokens.capacity() * sizeof(int32_t) +
               kv.second.active.capacity() * sizeof(int32_t);
    }
    for (const auto& kv : leaders_) {
      bytes += sizeof(kv) + kv.second.kids.capacity() * sizeof(kv.second.kids[0]);
    }
    return static_cast<int64_t>(bytes);
  }

  // Every non-root node as (path, count), in depth-first order with children by
  // token id.  Meant for tests and debugging only.
  std::vector<std::pair<std::vector<int32_t>, int64_t>> dump() const {
    std::vector<std::pair<std::vector<int32_t>, int64_t>> out;
    std::vector<int32_t> path;
    dump_rec(kRoot, path, out);
    return out;
  }

  void clear() {
    nodes_.assign(1, Node{});
    free_nodes_.clear();
    edge_lists_.clear();
    free_lists_.clear();
    root_kids_.clear();
    seqs_.clear();
    leaders_.clear();
    num_tokens_ = 0;
  }

  // Builds a draft continuing `context`.  See the class docstring for the semantics.
  Draft speculate(const std::vector<int32_t>& context, int budget, bool multi_path,
                  double min_prob, double max_spec_factor, int max_match_len,
                  double backoff) const {
    const size_t n = context.size();
    auto node_of = [&](int len) { return walk(context.data() + n - len, static_cast<size_t>(len)); };
    const int match_len = longest_match(match_cap(max_match_len, n), node_of);
    if (backoff > 0.0) {
      std::vector<int32_t>& orders = scratch_.orders;
      orders.resize(match_len + 1);
      for (int k = 0; k <= match_len; ++k) orders[k] = node_of(k);
      return draft_backed_off(budget, multi_path, min_prob, max_spec_factor, backoff);
    }
    return draft(node_of(match_len), match_len, budget, multi_path, min_prob, max_spec_factor);
  }

  // Same result as speculate(<tokens of sequence `key`>, ...), without walking from
  // the root: the sequence's own suffix nodes are already known.  The fast path for a
  // request whose output is stored in the tree it drafts from.
  Draft speculate_sequence(int64_t key, int budget, bool multi_path, double min_prob,
                           double max_spec_factor, int max_match_len, double backoff) const {
    auto it = seqs_.find(key);
    if (it == seqs_.end()) throw py::key_error("no sequence " + std::to_string(key));
    const std::vector<int32_t>& active = it->second.active;
    const int match_len = longest_match(match_cap(max_match_len, active.size() - 1),
                                        [&](int len) { return active[len]; });
    if (backoff > 0.0) {
      scratch_.orders.assign(active.begin(), active.begin() + match_len + 1);
      return draft_backed_off(budget, multi_path, min_prob, max_spec_factor, backoff);
    }
    return draft(active[match_len], match_len, budget, multi_path, min_prob, max_spec_factor);
  }

 private:
  static constexpr int32_t kRoot = 0;
  static constexpr int32_t kNoChild = -1;  // Node::tok: leaf
  static constexpr int32_t kMany = -2;     // Node::tok: `link` indexes edge_lists_
  // The root's children with tokens below this are found by token in root_kids_ (every
  // append and draft step looks one up, and the root has a child per distinct token);
  // larger tokens, if any, go to the root node's own edges.
  static constexpr int32_t kRootTable = 1 << 20;

 public:
  static constexpr int32_t kMaxWeight = 1 << 16;

 private:

  // A node's own count (weighted occurrences of its string) is kept by its parent: in
  // the edge list, in the root's table, or, for an only child, as the parent's child
  // total.  An append then writes each suffix's node once, not also its child's.
  struct Node {
    int32_t child_total = 0;  // sum of the children's counts
    int32_t tok = kNoChild;   // the only child's token, or kNoChild / kMany
    int32_t link = -1;        // the only child's node id, or an edge_lists_ index
  };
  // A child in an edge list, with its count: ranking a node's children reads one
  // contiguous list, not a cache line per child.
  struct Edge {
    int32_t tok;
    int32_t node;
    int32_t count;
  };
  struct Sequence {
    int32_t weight = 1;
    std::vector<int32_t> tokens;
    // active[k] = node of the sequence's last k tokens, for k < max_depth: exactly
    // the nodes that the next token extends.
    std::vector<int32_t> active;
  };

  static bool edge_tok_less(const Edge& e, int32_t t) { return e.tok < t; }

  int32_t find_child(int32_t v, int32_t t) const {
    if (v == kRoot && t < kRootTable) {
      return static_cast<size_t>(t) < root_kids_.size() ? root_kids_[t].node : -1;
    }
    const Node& n = nodes_[v];
    if (n.tok == kNoChild) return -1;
    if (n.tok != kMany) return n.tok == t ? n.link : -1;
    const std::vector<Edge>& l = edge_lists_[n.link];
    auto it = std::lower_bound(l.begin(), l.end(), t, edge_tok_less);
    return (it != l.end() && it->tok == t) ? it->node : -1;
  }

  int32_t walk(const int32_t* toks, size_t len) const {
    if (len > static_cast<size_t>(max_depth_)) return -1;
    int32_t v = kRoot;
    for (size_t i = 0; i < len && v >= 0; ++i) v = find_child(v, toks[i]);
    return v;
  }

  int32_t new_node() {
    if (!free_nodes_.empty()) {
      const int32_t id = free_nodes_.back();
      free_nodes_.pop_back();
      return id;
    }
    if (nodes_.size() >= static_cast<size_t>(INT32_MAX)) throw std::length_error("tree too large");
    nodes_.emplace_back();
    return static_cast<int32_t>(nodes_.size() - 1);
  }

  // Adds w (negative: removes) to the count of v's child t, creating the child if
  // absent, and to v's child total; returns the child, and its new count in `count`.
  // One search of v's edges both finds the child and updates its count.
  int32_t add_to_child(int32_t v, int32_t t, int32_t w, int32_t& count) {
    int32_t c = -1;
    if (v == kRoot && t < kRootTable) {
      if (static_cast<size_t>(t) >= root_kids_.size()) root_kids_.resize(t + 1);
      RootKid& kid = root_kids_[t];
      if (kid.node < 0) kid.node = new_node();
      c = kid.node;
      count = kid.count += w;
    } else if (nodes_[v].tok == kMany) {
      std::vector<Edge>& l = edge_lists_[nodes_[v].link];
      auto it = std::lower_bound(l.begin(), l.end(), t, edge_tok_less);
      if (it != l.end() && it->tok == t) {
        count = it->count += w;
        c = it->node;
      } else {
        c = new_node();  // touches nodes_ only: `it` stays valid
        l.insert(it, Edge{t, c, w});
        count = w;
      }
    } else if (nodes_[v].tok == t) {
      c = nodes_[v].link;
      count = nodes_[v].child_total + w;
    } else {
      c = new_node();  // may add a chunk: index nodes_, never hold references
      Node& n = nodes_[v];
      count = w;
      if (n.tok == kNoChild) {
        n.tok = t;
        n.link = c;
      } else {  // a second child: the inline one moves into an edge list
        int32_t slot;
        if (!free_lists_.empty()) {
          slot = free_lists_.back();
          free_lists_.pop_back();
        } else {
          slot = static_cast<int32_t>(edge_lists_.size());
          edge_lists_.emplace_back();
        }
        std::vector<Edge>& l = edge_lists_[slot];
        const Edge old{n.tok, n.link, n.child_total}, added{t, c, w};
        if (old.tok < t) {
          l = {old, added};
        } else {
          l = {added, old};
        }
        n.tok = kMany;
        n.link = slot;
      }
    }
    nodes_[v].child_total += w;
    return c;
  }

  // The count of v's child t (0 if absent).
  int32_t child_count(int32_t v, int32_t t) const {
    if (v == kRoot && t < kRootTable) {
      return static_cast<size_t>(t) < root_kids_.size() ? root_kids_[t].count : 0;
    }
    const Node& n = nodes_[v];
    if (n.tok == kNoChild) return 0;
    if (n.tok != kMany) return n.tok == t ? n.child_total : 0;
    const std::vector<Edge>& l = edge_lists_[n.link];
    auto it = std::lower_bound(l.begin(), l.end(), t, edge_tok_less);
    return (it != l.end() && it->tok == t) ? it->count : 0;
  }

  void unlink_child(int32_t v, int32_t t) {
    if (v == kRoot && t < kRootTable) {
      root_kids_[t] = RootKid{};
      return;
    }
    Node& n = nodes_[v];
    if (n.tok != kMany) {
      n.tok = kNoChild;
      n.link = -1;
      return;
    }
    std::vector<Edge>& l = edge_lists_[n.link];
    l.erase(std::lower_bound(l.begin(), l.end(), t, edge_tok_less));
    if (l.size() == 1) {  // back to the inline form
      const Edge only = l[0];  // its count stays in its node
      std::vector<Edge>().swap(l);
      free_lists_.push_back(n.link);
      n.tok = only.tok;
      n.link = only.node;
    }
  }

  void free_node(int32_t v) {
    leaders_.erase(v);
    Node& n = nodes_[v];
    if (n.tok == kMany) {
      std::vector<Edge>().swap(edge_lists_[n.link]);
      free_lists_.push_back(n.link);
    }
    n = Node{};
    free_nodes_.push_back(v);
  }

  // Rejects bad tokens, and tokens whose weighted count would overflow: the root
  // counts every weighted token and bounds every other count.
  void check_tokens(const std::vector<int32_t>& tokens, int32_t weight) const {
    for (int32_t t : tokens) {
      if (t < 0) throw std::invalid_argument("token ids must be >= 0, got " + std::to_string(t));
    }
    const int64_t total = static_cast<int64_t>(nodes_[kRoot].child_total) +
                          static_cast<int64_t>(tokens.size()) * weight;
    if (total > INT32_MAX) throw std::length_error("tree too large: weighted token count overflows");
  }

  void append_all(Sequence& s, const std::vector<int32_t>& tokens) {
    if (s.active.empty()) s.active.push_back(kRoot);
    for (int32_t t : tokens) append_token(s, t);
    num_tokens_ += static_cast<int64_t>(tokens.size());
  }

  void append_token(Sequence& s, int32_t t) {
    // Every suffix shorter than max_depth gains the new token.  Going from the longest
    // down lets active[k + 1] be overwritten once active[k + 1] itself was used.
    const size_t m = s.active.size();
    // The suffixes' nodes lie all over the tree: start all their cache misses at once.
    for (size_t k = 0; k < m; ++k) __builtin_prefetch(&nodes_[s.active[k]], 1);
    for (size_t k = m; k-- > 0;) {
      const int32_t parent = s.active[k];
      int32_t count;
      const int32_t c = add_to_child(parent, t, s.weight, count);
      if (k + 1 < static_cast<size_t>(max_depth_)) {
        if (k + 1 == m) {
          s.active.push_back(c);
        } else {
          s.active[k + 1] = c;
        }
      }
    }
    s.tokens.push_back(t);
  }

  // f(token, child node, child count) for each child of v, by increasing token.
  template <class F>
  void for_each_child(int32_t v, F&& f) const {
    if (v == kRoot) {  // the table's tokens all come before those of the root's node
      for (size_t t = 0; t < root_kids_.size(); ++t) {
        const RootKid& kid = root_kids_[t];
        if (kid.node >= 0) f(static_cast<int32_t>(t), kid.node, kid.count);
      }
    }
    const Node& n = nodes_[v];
    if (n.tok == kNoChild) return;
    if (n.tok != kMany) {
      f(n.tok, n.link, n.child_total);  // an only child holds all of v's continuations
      return;
    }
    for (const Edge& e : edge_lists_[n.link]) f(e.tok, e.node, e.count);
  }

  // The longest match allowed: -1 means max_depth / 2, which leaves at least half of
  // the trie's depth for the draft; never max_depth (those nodes have no children).
  int match_cap(int max_match_len, size_t available) const {
    const int cap = max_match_len < 0 ? max_depth_ / 2 : max_match_len;
    return static_cast<int>(std::min<size_t>(
        {static_cast<size_t>(cap), static_cast<size_t>(max_depth_ - 1), available}));
  }

  // Longest len <= cap whose node (node_of(len): the context's last len tokens, or -1)
  // exists and is followed by some token somewhere.  That property is monotone in len
  // (if w.c occurs, so does suffix(w).c), so a binary search suffices.
  template <class NodeOf>
  int longest_match(int cap, NodeOf&& node_of) const {
    auto ok = [&](int len) {
      const int32_t v = node_of(len);
      return v >= 0 && nodes_[v].child_total > 0;
    };
    if (!ok(0)) return 0;  // empty tree
    int lo = 0, hi = cap;
    while (lo < hi) {
      const int mid = lo + (hi - lo + 1) / 2;
      if (ok(mid)) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return lo;
  }

  Draft draft(int32_t start, int match_len, int budget, bool multi_path, double min_prob,
              double max_spec_factor) const {
    Draft out;
    std::get<3>(out) = match_len;
    if (match_len == 0) return out;
    if (max_spec_factor > 0.0) {  // budget = min(budget, int(factor * match_len))
      const double spec_cap = max_spec_factor * match_len;
      if (spec_cap < budget) budget = static_cast<int>(spec_cap);
    }
    if (budget <= 0) return out;
    if (multi_path) {
      draft_tree(start, budget, min_prob, out);
    } else {
      draft_path(start, budget, min_prob, out);
    }
    return out;
  }

  // Children of v as (count, tok, node), most frequent first, ties by smaller token.
  void sorted_children(int32_t v, std::vector<std::tuple<int32_t, int32_t, int32_t>>& out) const {
    out.clear();
    for_each_child(v, [&](int32_t t, int32_t c, int32_t count) { out.emplace_back(count, t, c); });
    std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
      if (std::get<0>(a) != std::get<0>(b)) return std::get<0>(a) > std::get<0>(b);
      return std::get<1>(a) < std::get<1>(b);
    });
  }

  void rank_children(int32_t v, size_t keep,
                     std::vector<std::tuple<int32_t, int32_t, int32_t>>& out) const {
    out.clear();
    for_each_child(v, [&](int32_t t, int32_t c, int32_t count) { out.emplace_back(count, t, c); });
    auto before = [](const auto& a, const auto& b) {
      if (std::get<0>(a) != std::get<0>(b)) return std::get<0>(a) > std::get<0>(b);
      return std::get<1>(a) < std::get<1>(b);
    };
    if (out.size() > keep) {
      std::nth_element(out.begin(), out.begin() + keep, out.end(), before);
      out.resize(keep);
    }
    std::sort(out.begin(), out.end(), before);
  }

  void draft_path(int32_t v, int budget, double min_prob, Draft& out) const {
    auto& toks = std::get<0>(out);
    auto& parents = std::get<1>(out);
    auto& probs = std::get<2>(out);
    double p = 1.0;
    while (static_cast<int>(toks.size()) < budget) {
      int32_t best_tok = -1, best = -1, best_count = 0;
      for_each_child(v, [&](int32_t t, int32_t c, int32_t count) {
        // Children are visited by increasing token, so '>' keeps the smaller token on ties.
        if (count > best_count) {
          best_count = count;
          best_tok = t;
          best = c;
        }
      });
      if (best < 0) break;
      const double q = p * (static_cast<double>(best_count) / nodes_[v].child_total);
      if (q < min_prob) break;
      parents.push_back(static_cast<int32_t>(toks.size()) - 1);
      toks.push_back(best_tok);
      probs.push_back(q);
      p = q;
      v = best;
    }
  }

  struct Cand {
    double p;
    int32_t depth;
    int32_t node;    // what it expands from: its trie node (backed off: its parent's context)
    int32_t parent;  // index in the output, -1 under the matched node
    int32_t tok;
  };

  // Heap order of draft candidates (true if a ranks after b): path probability desc,
  // depth asc, token path lexicographically asc.  Two same-depth paths are compared by
  // climbing the output (`toks`, `parents`) until both hang off the same node.
  struct RanksAfter {
    const std::vector<int32_t>& toks;
    const std::vector<int32_t>& parents;
    bool operator()(const Cand& a, const Cand& b) const {
      if (a.p != b.p) return a.p < b.p;
      if (a.depth != b.depth) return a.depth > b.depth;
      int32_t pa = b.parent, ta = b.tok, pb = a.parent, tb = a.tok;
      while (pa != pb) {
        ta = toks[pa];
        tb = toks[pb];
        pa = parents[pa];
        pb = parents[pb];
      }
      return ta < tb;  // b's path before a's
    }
  };

  // Best-first expansion.  Candidates are ranked by (path probability desc, depth asc,
  // token path lexicographically asc); a child never ranks before its parent, so the
  // output is exactly the `budget` best-ranked nodes with p >= min_prob, in rank order
  // (hence parents before children).
  void draft_tree(int32_t start, int budget, double min_prob, Draft& out) const {
    const auto& toks = std::get<0>(out);
    CandHeap heap(RanksAfter{toks, std::get<1>(out)});
    std::vector<std::tuple<int32_t, int32_t, int32_t>> kids;

    auto push_children = [&](int32_t v, double p, int32_t depth, int32_t parent) {
      sorted_children(v, kids);
      // Only the best `remaining` siblings can ever be taken: each outranks the next.
      const size_t remaining = static_cast<size_t>(budget) - toks.size();
      const double total = nodes_[v].child_total;
      for (size_t i = 0; i < kids.size() && i < remaining; ++i) {
        const double q = p * (std::get<0>(kids[i]) / total);
        if (q < min_prob) break;  // siblings come in decreasing probability
        heap.push(Cand{q, depth + 1, std::get<2>(kids[i]), parent, std::get<1>(kids[i])});
      }
    };

    push_children(start, 1.0, 0, -1);
    take_best(budget, heap, out, [&](const Cand& c, int32_t idx) {
      push_children(c.node, c.p, c.depth, idx);
    });
  }

  using CandHeap = std::priority_queue<Cand, std::vector<Cand>, RanksAfter>;

  // Moves the best candidate into the output until it holds `budget` nodes or none is
  // left; `expand(candidate, its output index)` pushes the candidate's children.
  template <class Expand>
  static void take_best(int budget, CandHeap& heap, Draft& out, Expand&& expand) {
    auto& toks = std::get<0>(out);
    while (!heap.empty() && static_cast<int>(toks.size()) < budget) {
      const Cand c = heap.top();
      heap.pop();
      const int32_t idx = static_cast<int32_t>(toks.size());
      toks.push_back(c.tok);
      std::get<1>(out).push_back(c.parent);
      std::get<2>(out).push_back(c.p);
      if (static_cast<int>(toks.size()) < budget) expand(c, idx);
    }
  }

  // Backed-off drafts (backoff > 0): the next token's distribution mixes every matched
  // context length, not just the longest.  orders[k] is the node of the context's last
  // k tokens (orders[0] the root).  Each context's distribution has a Dirichlet prior
  // centred on the next shorter context's, `backoff` pseudo-counts strong:
  //   p_k(t) = (count_k(t) + backoff * p_{k-1}(t)) / (child_total_k + backoff),
  // from k = 1 (the root's unigram counts are left out: p_0 = 0) to the longest match.
  // A deep match seen once or twice no longer claims certainty, so the tree spends its
  // nodes on the likeliest alternatives of every length instead of one long path.
  // Only the `keep` likeliest tokens of each context are mixed (no draft needs more).
  // Extending a draft by token t moves every context one token on: the new orders are
  // the root and the t-children of the old ones, as deep as they exist.
  using Kids = std::vector<std::tuple<int32_t, int32_t, int32_t>>;
  using TokProb = std::pair<int32_t, double>;

  // Token id -> index into a list, for merging the contexts' children: open addressing,
  // emptied in O(1) by bumping a generation stamp (a draft merges ~16 lists per call).
  class TokenIndex {
   public:
    // Empties the index, sized for up to `entries` tokens.  Only the first slots that
    // many tokens need are used, so that a draft's merges stay in a few cache lines
    // even after one needed many more.
    void reset(size_t entries) {
      size_t cap = 32;
      while (cap < 2 * entries) cap <<= 1;
      if (cap > slots_.size()) slots_.resize(cap);
      mask_ = cap - 1;
      shift_ = 32 - __builtin_ctzll(cap);
      if (++gen_ == 0) {  // stamps wrapped: clear them for real
        for (Slot& s : slots_) s.gen = 0;
        gen_ = 1;
      }
    }
    // The index stored for `tok`, or a fresh slot (set to -1) to store it in.
    int32_t& operator[](int32_t tok) {
      const size_t mask = mask_;
      size_t i = (static_cast<uint32_t>(tok) * 0x9E3779B1u) >> shift_;
      while (slots_[i].gen == gen_ && slots_[i].tok != tok) i = (i + 1) & mask;
      Slot& s = slots_[i];
      if (s.gen != gen_) s = Slot{gen_, tok, -1};
      return s.index;
    }

   private:
    struct Slot {
      uint32_t gen = 0;
      int32_t tok = 0;
      int32_t index = -1;
    };
    std::vector<Slot> slots_;
    uint32_t gen_ = 0;
    size_t mask_ = 0;
    int shift_ = 27;
  };

  // A context is drafted from as its runs: maximal ranges of context lengths whose nodes
  // have one child total.  Such nodes have the same children with the same counts (a
  // longer context's occurrences map one to one onto the shorter one's), so one node
  // stands for the whole run, both to mix its children and to extend it by a token: the
  // children of a run's nodes form a run again (their child totals agree, except at
  // max_depth, where a node has no children).  A draft step then touches a node per
  // run, not one per context length.
  struct Run {
    int32_t node;         // the node of the run's shortest context
    int32_t child_total;  // > 0: contexts without continuations are left out
    int32_t len;          // the run's shortest context length
    int32_t width;        // how many context lengths it spans
  };

  // Reused by every backed-off draft (the tree is not thread-safe anyway), so a draft
  // call allocates nothing but its result.
  struct Scratch {
    std::vector<int32_t> orders;  // the caller's context: orders[k], k = 0 .. match_len
    std::vector<Run> runs;        // every context drafted from, shortest run first
    std::vector<size_t> starts;   // context i is runs[starts[i] .. starts[i + 1])
    std::vector<TokProb> next;
    std::vector<std::pair<int32_t, double>> mix;  // (node, share) per run, longest first
    Kids kids;
    TokenIndex index;
    std::vector<Cand> heap;
  };

  // Appends the run of context length `len` (node v) to s.runs, joining the previous run
  // when it ends just below with the same child total.  False when v has no
  // continuation: neither has any longer context.
  bool add_run(Scratch& s, size_t first, int32_t v, int32_t len, int32_t width) const {
    const int32_t total = nodes_[v].child_total;
    if (total == 0) return false;
    if (s.runs.size() > first) {
      Run& last = s.runs.back();
      if (last.child_total == total && last.len + last.width == len) {
        last.width += width;
        return true;
      }
    }
    s.runs.push_back(Run{v, total, len, width});
    return true;
  }

  // Adds share * count of the `keep` most frequent children of v (ties: smaller token)
  // into next.  Children of a context come with distinct tokens, so the order they are
  // added in does not matter: each token's sum is taken over contexts, longest first.
  void mix_children(int32_t v, size_t keep, double share, Scratch& s) const {
    auto add = [&](int32_t tok, int32_t count) {
      const double x = share * count;
      int32_t& at = s.index[tok];
      if (at < 0) {
        at = static_cast<int32_t>(s.next.size());
        s.next.emplace_back(tok, x);
      } else {
        s.next[at].second += x;
      }
    };
    const Node& n = nodes_[v];  // never the root: order 0 is not mixed
    if (n.tok != kMany) {  // one child (a context with no child has no run to mix)
      add(n.tok, n.child_total);
      return;
    }
    const std::vector<Edge>& l = edge_lists_[n.link];
    if (l.size() <= keep) {  // all of them: no ranking needed
      for (const Edge& e : l) add(e.tok, e.count);
      return;
    }
    // Nodes with many children (a common token's continuations) keep their leaders in
    // `leaders_`, valid while the node's child_total is what it was: counts only grow on
    // append and shrink on remove, so any change moves the total, and a freed node drops
    // its entry.
    if (l.size() > kManyChildren && keep <= kLeaders) {
      Leaders& entry = leaders_[v];
      if (entry.total != n.child_total) {
        rank_children(v, kLeaders, entry.kids);
        entry.total = n.child_total;
      }
      const size_t m = std::min(keep, entry.kids.size());
      for (size_t i = 0; i < m; ++i) add(std::get<1>(entry.kids[i]), std::get<0>(entry.kids[i]));
      return;
    }
    rank_children(v, keep, s.kids);
    for (const auto& kid : s.kids) add(std::get<1>(kid), std::get<0>(kid));
  }

  // The mixed next-token distribution of context i, reduced to what a draft can still
  // take: the `take` best tokens (probability desc, token asc) whose path probability
  // p * x stays >= min_prob, in that order, in s.next.
  void backed_off_next(size_t i, double backoff, size_t keep, double p, double min_prob,
                       size_t take, Scratch& s) const {
    // Unrolled from the longest context down, p_K(t) = sum over k of
    // weight_k * count_k(t) / (child_total_k + backoff), where weight_k is the product of
    // backoff / (child_total_j + backoff) over the longer contexts j.  Each run adds its
    // children once, at its lengths' summed share (contexts without continuations, all
    // longer than the runs, would multiply the weight by backoff / backoff = 1).
    // First the shares, then the children: the index is sized for the tokens the runs
    // can add (one for an only child), and stays small.
    s.mix.clear();
    size_t bound = 0;
    double weight = 1.0;
    for (size_t r = s.starts[i + 1]; r-- > s.starts[i];) {
      const Run& run = s.runs[r];
      const double denom = run.child_total + backoff;
      double share = 0.0;  // the run's summed weight_k / denom
      for (int32_t j = 0; j < run.width; ++j) {
        share += weight / denom;
        weight *= backoff / denom;
      }
      s.mix.emplace_back(run.node, share);
      bound += nodes_[run.node].tok == kMany ? keep : 1;
    }
    s.next.clear();
    s.index.reset(bound);
    for (const auto& [node, share] : s.mix) mix_children(node, keep, share, s);
    // Tokens below min_prob would end the draft's walk over the sorted list anyway, and
    // past the `take` best none is read: select before sorting.
    auto& next = s.next;
    next.erase(std::remove_if(next.begin(), next.end(),
                              [&](const TokProb& tp) { return p * tp.second < min_prob; }),
               next.end());
    auto before = [](const TokProb& a, const TokProb& b) {
      if (a.second != b.second) return a.second > b.second;
      return a.first < b.first;
    };
    if (next.size() > take) {
      std::nth_element(next.begin(), next.begin() + take, next.end(), before);
      next.resize(take);
    }
    std::sort(next.begin(), next.end(), before);
  }

  // Appends context i extended by `tok` as a new context: the root's child (length 1),
  // then each run's children, as deep as they exist.
  void advance(Scratch& s, size_t i, int32_t tok) const {
    // The runs' children lie all over the tree: start their cache misses at once.
    for (size_t r = s.starts[i]; r < s.starts[i + 1]; ++r) {
      const int32_t child = find_child(s.runs[r].node, tok);
      if (child < 0) break;
      __builtin_prefetch(&nodes_[child]);
    }
    const size_t first = s.runs.size();
    const int32_t c = find_child(kRoot, tok);
    if (c >= 0 && add_run(s, first, c, 1, 1)) {
      for (size_t r = s.starts[i]; r < s.starts[i + 1]; ++r) {
        const Run run = s.runs[r];  // a copy: add_run may reallocate s.runs
        const int32_t child = find_child(run.node, tok);
        if (child < 0) break;  // no longer context with tok exists either
        // A context of max_depth tokens has no continuation: leave it out.
        const int32_t width = std::min(run.width, max_depth_ - 1 - run.len);
        if (width <= 0 || !add_run(s, first, child, run.len + 1, width)) break;
        if (width < run.width) break;
      }
    }
    s.starts.push_back(s.runs.size());
  }

  // Drafts from the context whose orders are in scratch_.orders (filled by the caller).
  Draft draft_backed_off(int budget, bool multi_path, double min_prob, double max_spec_factor,
                         double backoff) const {
    Scratch& s = scratch_;
    Draft out;
    const int match_len = static_cast<int>(s.orders.size()) - 1;
    std::get<3>(out) = match_len;
    if (match_len == 0) return out;
    if (max_spec_factor > 0.0) {
      const double spec_cap = max_spec_factor * match_len;
      if (spec_cap < budget) budget = static_cast<int>(spec_cap);
    }
    if (budget <= 0) return out;
    auto& toks = std::get<0>(out);
    auto& parents = std::get<1>(out);
    auto& probs = std::get<2>(out);
    toks.reserve(budget);
    parents.reserve(budget);
    probs.reserve(budget);
    const size_t keep = static_cast<size_t>(budget);
    s.runs.clear();
    for (int k = 1; k <= match_len; ++k) {
      if (!add_run(s, 0, s.orders[k], k, 1)) break;
    }
    s.starts.assign({0, s.runs.size()});
    if (!multi_path) {
      double p = 1.0;
      for (size_t i = 0; static_cast<int>(toks.size()) < budget; ++i) {
        backed_off_next(i, backoff, keep, p, min_prob, 1, s);
        if (s.next.empty()) break;
        const double q = p * s.next[0].second;
        parents.push_back(static_cast<int32_t>(toks.size()) - 1);
        toks.push_back(s.next[0].first);
        probs.push_back(q);
        p = q;
        advance(s, i, s.next[0].first);
      }
      return out;
    }
    // A binary heap on the reused vector; RanksAfter is a total order on the candidates,
    // so the pop order does not depend on how the heap arranges ties.
    const RanksAfter after{toks, parents};
    std::vector<Cand>& heap = s.heap;
    heap.clear();
    auto push_children = [&](int32_t from, double p, int32_t depth, int32_t parent) {
      // Only the best `remaining` siblings can ever be taken: each outranks the next.
      backed_off_next(static_cast<size_t>(from), backoff, keep, p, min_prob, keep - toks.size(), s);
      for (const TokProb& tp : s.next) {
        heap.push_back(Cand{p * tp.second, depth + 1, from, parent, tp.first});
        std::push_heap(heap.begin(), heap.end(), after);
      }
    };
    push_children(0, 1.0, 0, -1);
    while (!heap.empty() && static_cast<int>(toks.size()) < budget) {
      std::pop_heap(heap.begin(), heap.end(), after);
      const Cand c = heap.back();
      heap.pop_back();
      const int32_t idx = static_cast<int32_t>(toks.size());
      toks.push_back(c.tok);
      parents.push_back(c.parent);
      probs.push_back(c.p);
      if (static_cast<int>(toks.size()) < budget) {
        advance(s, static_cast<size_t>(c.node), c.tok);
        push_children(static_cast<int32_t>(s.starts.size()) - 2, c.p, c.depth, idx);
      }
    }
    return out;
  }

  void dump_rec(int32_t v, std::vector<int32_t>& path,
                std::vector<std::pair<std::vector<int32_t>, int64_t>>& out) const {
    for_each_child(v, [&](int32_t t, int32_t c, int32_t count) {
      path.push_back(t);
      out.emplace_back(path, count);
      dump_rec(c, path, out);
      path.pop_back();
    });
  }

  int max_depth_;
  ChunkedVector<Node> nodes_;
  std::vector<int32_t> free_nodes_;
  std::vector<std::vector<Edge>> edge_lists_;
  std::vector<int32_t> free_lists_;
  struct RootKid {
    int32_t node = -1;  // -1: no child with this token
    int32_t count = 0;
  };
  std::vector<RootKid> root_kids_;  // by token: the root's children
  std::unordered_map<int64_t, Sequence> seqs_;
  // Nodes with more than kManyChildren children: their kLeaders most frequent, as of a total.
  static constexpr size_t kManyChildren = 8;
  static constexpr size_t kLeaders = 64;
  struct Leaders {
    int32_t total = -1;
    std::vector<std::tuple<int32_t, int32_t, int32_t>> kids;
  };
  mutable std::unordered_map<int32_t, Leaders> leaders_;  // a cache: speculate stays const
  mutable Scratch scratch_;
  int64_t num_tokens_ = 0;  // tokens stored (unweighted)
};

}  // namespace seer

PYBIND11_MODULE(_C, m) {
  m.doc() = "C++ core of seer_engine: the group suffix tree used as the draft source.";

  py::class_<seer::GroupSuffixTree>(m, "GroupSuffixTree", R"doc(
Bounded-depth suffix trie with occurrence counts over the token sequences of one group
(a prompt and its sibling responses).  Not thread-safe.

speculate(context, budget, multi_path, min_prob, max_spec_factor, max_match_len)
  match_len: longest suffix of `context` (at most max_match_len tokens; -1 means
  max_depth // 2, and never more than max_depth - 1) that occurs somewhere followed by
  at least one token.  0 means no match and an empty draft.
  budget: at most `budget` draft nodes; if max_spec_factor > 0, at most
  int(max_spec_factor * match_len).
  Counts are weighted: a sequence added with weight k counts as k copies of it.
  Conditional probability of child c of v: count(c) / sum of v's children counts; a
  node's prob is the product along its path from the matched node; nodes need
  prob >= min_prob.
  Single path: follow the most frequent child (ties: smaller token).
  Multi-path: the `budget` best nodes ranked by (prob desc, depth asc, token path asc).
  backoff > 0: a token's probability mixes every matched context length, from 1 to
  match_len: p_k(t) = (count_k(t) + backoff * p_(k-1)(t)) / (child_total_k + backoff)
  with p_0 = 0, only the `budget` likeliest tokens of each context mixed; a draft
  node's context is the context plus its path (each length as deep as it occurs).
  Ranking and output order as above, on these probabilities.
  Returns (tokens, parents, probs, match_len); parents[i] is the index of node i's
  parent, -1 for children of the last context token; parents precede children.
)doc")
      .def(py::init<int>(), py::arg("max_depth") = 64)
      .def_property_readonly("max_depth", &seer::GroupSuffixTree::max_depth)
      .def("add_sequence", &seer::GroupSuffixTree::add_sequence, py::arg("key"),
           py::arg("tokens"), py::arg("weight") = 1,
           "Start a new sequence whose occurrences count `weight` times (KeyError if the key exists).")
      .def("extend", &seer::GroupSuffixTree::extend, py::arg("key"), py::arg("tokens"),
           "Append tokens to a sequence, creating it if needed; O(max_depth) per token.")
      .def("append", &seer::GroupSuffixTree::append, py::arg("key"), py::arg("tokens"),
           py::arg("weight") = 1,
           "extend() if the sequence exists, else add_sequence(key, tokens, weight).")
      .def("remove_sequence", &seer::GroupSuffixTree::remove_sequence, py::arg("key"),
           "Remove a sequence's occurrences and free nodes left empty (KeyError if absent).")
      .def("has_sequence", &seer::GroupSuffixTree::has_sequence, py::arg("key"))
      .def("__contains__", &seer::GroupSuffixTree::has_sequence, py::arg("key"))
      .def("sequence_length", &seer::GroupSuffixTree::sequence_length, py::arg("key"))
      .def("sequence_weight", &seer::GroupSuffixTree::sequence_weight, py::arg("key"))
      .def("sequence_keys", &seer::GroupSuffixTree::sequence_keys)
      .def("count", &seer::GroupSuffixTree::count, py::arg("path"),
           "Weighted occurrences of a token path (0 if absent or longer than max_depth).")
      .def("num_nodes", &seer::GroupSuffixTree::num_nodes, "Live nodes, root included.")
      .def("num_sequences", &seer::GroupSuffixTree::num_sequences)
      .def("num_tokens", &seer::GroupSuffixTree::num_tokens, "Tokens stored (unweighted).")
      .def("memory_bytes", &seer::GroupSuffixTree::memory_bytes)
      .def("dump", &seer::GroupSuffixTree::dump, "All (path, count) pairs; for tests.")
      .def("clear", &seer::GroupSuffixTree::clear)
      .def("speculate", &seer::GroupSuffixTree::speculate, py::arg("context"),
           py::arg("budget"), py::arg("multi_path") = false, py::arg("min_prob") = 0.1,
           py::arg("max_spec_factor") = 0.0, py::arg("max_match_len") = -1,
           py::arg("backoff") = 0.0)
      .def("speculate_sequence", &seer::GroupSuffixTree::speculate_sequence, py::arg("key"),
           py::arg("budget"), py::arg("multi_path") = false, py::arg("min_prob") = 0.1,
           py::arg("max_spec_factor") = 0.0, py::arg("max_match_len") = -1,
           py::arg("backoff") = 0.0,
           "speculate() with the stored sequence `key` as the context (KeyError if absent).");
}
