// galva-search DP core: choose one strategy per layer of a pipeline stage.
//
// Problem. L layers, S strategies. Choosing strategy s_l for layer l costs intra(l, s_l) time and memory(l, s_l) MiB,
// and moving from s_{l-1} to s_l costs inter(l, s_{l-1}, s_l) time (layer 0 has no incoming transition). Minimise
//     T(s) = sum_l intra(l, s_l) + sum_{l>=1} inter(l, s_{l-1}, s_l)   subject to   M(s) = sum_l memory(l, s_l) <= B.
// All inputs are >= 0; +inf marks a forbidden choice or transition; NaN is rejected.
//
// Algorithm (exact, no memory discretisation).
//  1. Strategy dominance. At layer l, strategy j is dropped when some k is no worse in memory, in intra time, in every
//     incoming transition inter(l, i, .) and every outgoing one inter(l+1, ., x), and strictly better somewhere or
//     equal with k < j. Swapping j for k in any plan keeps it feasible and no slower, and the relation is a strict
//     partial order, so an undominated strategy is always left. Layers of one type share their cost rows, so the
//     O(S^3) test runs once per run of identical layers and is reused.
//  2. Lagrangian bounds. For a multiplier lam >= 0 a backward Viterbi pass gives, for every (l, j),
//     W_lam(l, j) = min over continuations of sum_{k>l} (inter + intra + lam * memory), in O(L S^2). Any feasible
//     continuation of a partial plan that used m MiB then costs at least W_lam(l, j) - lam * (B - m) time (weak
//     duality). lam = 0 solves the problem outright when the fastest plan fits. Otherwise the multiplier is found by
//     the breakpoint (secant) iteration on the concave piecewise-linear dual, a handful of O(L S^2) passes. Every plan
//     it meets that fits gives an upper bound UB; so does every splice "head of plan p + tail of plan q" of the plans
//     it met (O(P^2 L) with prefix sums), which is often the optimum when layers share costs. When the dual bound
//     meets UB the plan is proven optimal and the DP below is skipped.
//  3. Pareto DP. For each layer l and last strategy j keep the front F(l, j) of partial plans (memory m, time t) that
//     no other partial plan ending in j beats in both. F(l, j) = Pareto( { (m + memory(l,j), t + inter(l,i,j) +
//     intra(l,j)) : (m, t) in F(l-1, i) } ). All fronts of layer l-1 are merged once, sorted by memory (the memory
//     shift does not depend on j), and one sweep per j keeps the points whose time beats every point of less memory.
//     A point is also dropped when (a) m plus the smallest memory the remaining layers can use exceeds B (the sweep
//     stops there, since memory is sorted), (b) t plus the step-2 bound is >= UB, or (c) a point (m', t') of another
//     front F(l, k) has m' <= m and t' + max_x [inter(l+1, k, x) - inter(l+1, j, x)] <= t (every completion of the
//     first is matched by the same completion of the second; points are removed one by one and only by points still
//     present, so every removed point keeps a surviving dominator). Drops (a) and (c) never remove the last optimal
//     partial plan; (b) only removes partial plans that cannot beat the UB plan, which is kept as the fallback answer.
//     So the result is optimal: the Pareto recurrence is the classic exact DP for a knapsack with a chain of state
//     transitions (a dominated partial plan can always be replaced by its dominator in any completion).
//  Complexity. O(sum_l (N_l log N_l + S_l * N_l)) for the DP, where N_l = sum_j |F(l-1, j)| and S_l = live
//  strategies, plus O(L S^2) per Viterbi pass. The front size is bounded by the number of distinct memory sums that
//  survive pruning; with memory_resolution > 0 (memory rounded UP to a grid, so every plan returned truly fits) it is
//  also bounded by B / resolution + 1, which gives the reference's O(L * M * S^2) as a worst case. In practice the
//  bounds keep a few to a few hundred points per front, against M ~ 30k-80k states for every (layer, strategy) in
//  the reference's 1-MiB table.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace galva {
namespace dp {

constexpr double kInf = std::numeric_limits<double>::infinity();

// One stage's inputs, row-major: intra/memory [L][S], inter [L][S][S] (from i at layer l-1 to j at layer l). Layers
// of one type share their transitions: with ``block`` (one entry per layer) ``inter`` holds only the distinct [S][S]
// blocks and layer l's is block[l] (a stage of 32 layers of one type passes 2 blocks, not 32).
struct StageProblem {
  int layers = 0;
  int strategies = 0;
  std::vector<double> intra;
  std::vector<double> memory;
  std::vector<double> inter;
  std::vector<int> block;  // empty: inter is [L][S][S]
  double budget = 0.0;

  double intra_at(int l, int s) const { return intra[static_cast<size_t>(l) * strategies + s]; }
  double memory_at(int l, int s) const { return memory[static_cast<size_t>(l) * strategies + s]; }
  size_t block_of(int l) const { return block.empty() ? static_cast<size_t>(l) : static_cast<size_t>(block[l]); }
  // transitions into layer l from candidate i of layer l - 1: [S] values
  const double* inter_row(int l, int i) const {
    return &inter[(block_of(l) * strategies + static_cast<size_t>(i)) * strategies];
  }
  double inter_at(int l, int i, int j) const { return inter_row(l, i)[j]; }
};

struct Options {
  double memory_resolution = 0.0;  // 0: exact; > 0: memory rounded up to multiples of it (plans still fit)
  bool prune_strategies = true;    // step 1
  bool use_bounds = true;          // step 2 (and bound pruning in step 3)
  bool cross_prune = true;         // step 3: dominance across fronts with different last strategies
  // A plan slower than this is of no use to the caller (stage_levels.hpp: another level already has one this fast):
  // the solver may answer "above the cutoff" instead of solving (StageSolution::above_cutoff). Any plan it returns is
  // still the optimum.
  double cutoff = kInf;
};

struct Stats {
  long long front_points = 0;  // points kept over all fronts
  long long max_front = 0;     // largest single front
  int dual_passes = 0;         // Viterbi passes of step 2
  int live_strategies = 0;     // sum over layers of strategies left by step 1
  long long cross_pruned = 0;  // front points removed by dominance across fronts
  std::string method;          // "unconstrained" | "dual" | "pareto" | "infeasible" | "empty"
};

struct StageSolution {
  bool feasible = false;
  std::vector<int> choice;
  double time = 0.0;
  double memory = 0.0;
  bool above_cutoff = false;  // not feasible: no plan within Options::cutoff (there may be slower ones)
};

inline std::string format_value(double v) {
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

inline void check_value(double v, const char* array, int a, int b, int c) {
  if (!(std::isnan(v) || v < 0)) return;
  std::ostringstream os;
  os << array << "[" << a << "][" << b << "]";
  if (c >= 0) os << "[" << c << "]";
  os << " = " << format_value(v) << ": costs and memory must be >= 0 (+inf marks a forbidden choice), not "
     << (std::isnan(v) ? "NaN" : "negative");
  throw std::invalid_argument(os.str());
}

// Throws std::invalid_argument naming the array and index of the first bad entry. ``repeated`` (optional, one entry
// per layer): layer l's transition block is known to equal layer l - 1's, so it holds the same values (and the same
// first bad one) and is not scanned again.
inline void validate(const StageProblem& p, const std::vector<char>* repeated = nullptr) {
  if (p.layers < 0 || p.strategies < 0) throw std::invalid_argument("layer and strategy counts must be >= 0");
  if (p.layers > 0 && p.strategies == 0) throw std::invalid_argument("every layer needs at least one strategy");
  const size_t ls = static_cast<size_t>(p.layers) * p.strategies;
  if (p.intra.size() != ls) throw std::invalid_argument("intra_time must have layers*strategies entries");
  if (p.memory.size() != ls) throw std::invalid_argument("memory_mib must have layers*strategies entries");
  const size_t ss = static_cast<size_t>(p.strategies) * p.strategies;
  std::vector<char> checked;  // per block: already checked at an earlier layer
  if (p.block.empty()) {
    if (p.inter.size() != ls * p.strategies)
      throw std::invalid_argument("inter_time must have layers*strategies*strategies entries");
  } else {
    if (p.block.size() != static_cast<size_t>(p.layers)) throw std::invalid_argument("block must have one entry per layer");
    if (ss == 0 || p.inter.size() % ss != 0)
      throw std::invalid_argument("inter_time must hold whole strategies*strategies blocks");
    for (int b : p.block)
      if (b < 0 || static_cast<size_t>(b) >= p.inter.size() / ss)
        throw std::invalid_argument("block: an index outside inter_time's blocks");
    checked.assign(p.inter.size() / ss, 0);
  }
  if (std::isnan(p.budget)) throw std::invalid_argument("budget_mib is NaN");
  for (int l = 0; l < p.layers; ++l)
    for (int s = 0; s < p.strategies; ++s) check_value(p.intra_at(l, s), "intra_time", l, s, -1);
  for (int l = 0; l < p.layers; ++l)
    for (int s = 0; s < p.strategies; ++s) check_value(p.memory_at(l, s), "memory_mib", l, s, -1);
  for (int l = 1; l < p.layers; ++l) {  // layer 0's transitions are ignored
    if (repeated && l >= 2 && (*repeated)[l]) continue;
    if (!p.block.empty()) {  // a block is checked at the first layer (after layer 0) that uses it
      if (checked[p.block_of(l)]) continue;
      checked[p.block_of(l)] = 1;
    }
    for (int i = 0; i < p.strategies; ++i)
      for (int j = 0; j < p.strategies; ++j) check_value(p.inter_at(l, i, j), "inter_time", l, i, j);
  }
}

// Time and memory of a plan, summed layer by layer in the order the DP accumulates them.
inline void plan_cost(const StageProblem& p, const std::vector<int>& choice, double& time, double& memory) {
  time = 0.0;
  memory = 0.0;
  for (int l = 0; l < p.layers; ++l) {
    if (l > 0) time += p.inter_at(l, choice[l - 1], choice[l]);
    time += p.intra_at(l, choice[l]);
    memory += p.memory_at(l, choice[l]);
  }
}

class StageSolver {
 public:
  StageSolver(const StageProblem& p, const Options& o) : StageSolver(p, o, p.budget) {}
  // ``budget`` in place of p.budget: one problem's arrays solved under several budgets without copies
  StageSolver(const StageProblem& p, const Options& o, double budget)
      : p_(p),
        opt_(o),
        L_(p.layers),
        S_(p.strategies),
        budget_(budget),
        cut_(std::isfinite(o.cutoff) ? o.cutoff + 1e-9 * std::fabs(o.cutoff) : kInf) {}

  StageSolution solve(Stats* stats) {
    Stats local;
    Stats& st = stats ? *stats : local;
    StageSolution out;
    if (L_ == 0) {
      out.feasible = budget_ >= 0;
      st.method = out.feasible ? "empty" : "infeasible";
      return out;
    }
    prepare_memory();
    mark_live();
    for (int l = 0; l < L_; ++l)
      for (int s = 0; s < S_; ++s) st.live_strategies += live_[idx(l, s)];
    // Smallest memory the layers l.. can use; infeasible when even that does not fit.
    suffix_min_mem_.assign(L_ + 1, 0.0);
    layer_min_.assign(L_, kInf);
    for (int l = L_ - 1; l >= 0; --l) {
      for (int s = 0; s < S_; ++s)
        if (live_[idx(l, s)]) layer_min_[l] = std::min(layer_min_[l], mem_[idx(l, s)]);
      suffix_min_mem_[l] = layer_min_[l] + suffix_min_mem_[l + 1];
    }
    // (the slack covers summing in another order than the plan does; the exact test is on whole plans)
    if (!(suffix_min_mem_[0] <= budget_ + 1e-12 * (std::fabs(budget_) + 1.0))) return infeasible(st);

    std::vector<int> ub_plan;
    double ub = kInf;
    bool cutting = false;  // ub is the cutoff
    if (opt_.use_bounds) {
      if (dual_search(st, ub_plan, ub)) return finish(ub_plan, st, "dual");
      if (st.method == "unconstrained") return finish(ub_plan, st, "unconstrained");
      if (st.method == "infeasible") return infeasible(st);
      if (cut_ < ub) {  // only a plan within the cutoff matters: none when the dual bound is above it
        if (lb_ > cut_) return above(st);
        ub = cut_;
        ub_plan.clear();
        cutting = true;
      }
    }
    std::vector<int> plan;
    if (pareto(st, ub, plan)) return finish(plan, st, "pareto");
    if (!ub_plan.empty()) return finish(ub_plan, st, "dual");
    return cutting ? above(st) : infeasible(st);
  }

 private:
  struct Point {
    double m, t;
    int32_t prev_s, prev_idx;
  };
  struct Cand {
    double m, t;
    int32_t s, idx;
  };
  struct Pass {  // one backward Viterbi pass at multiplier lam
    double lam = 0.0;
    double value = kInf;                 // min over plans of T + lam * M
    std::vector<double> w;               // w[l*S+j]: best continuation after (l, j)
    std::vector<int> plan;               // the minimising plan (empty if none)
    double time = kInf, memory = kInf;   // its true cost
  };

  size_t idx(int l, int s) const { return static_cast<size_t>(l) * S_ + s; }

  void prepare_memory() {
    mem_ = p_.memory;
    const double r = opt_.memory_resolution;
    if (r > 0) {
      for (double& v : mem_) {
        if (!std::isfinite(v)) continue;
        double g = std::ceil(v / r) * r;
        while (g < v) g += r;  // guard against rounding down in floating point
        v = g;
      }
    }
  }

  bool same_rows(int a, int b) const {
    const size_t n = static_cast<size_t>(S_);
    if (std::memcmp(&p_.intra[idx(a, 0)], &p_.intra[idx(b, 0)], n * sizeof(double)) != 0) return false;
    if (std::memcmp(&mem_[idx(a, 0)], &mem_[idx(b, 0)], n * sizeof(double)) != 0) return false;
    return true;
  }
  bool same_inter(int a, int b) const {  // transition blocks into layers a and b (a, b >= 1)
    if (p_.block_of(a) == p_.block_of(b)) return true;
    const size_t n = static_cast<size_t>(S_) * S_;
    return std::memcmp(p_.inter_row(a, 0), p_.inter_row(b, 0), n * sizeof(double)) == 0;
  }

  // Step 1: live_[l*S+s] = 1 unless forbidden (+inf) or dominated at layer l.
  void mark_live() {
    live_.assign(static_cast<size_t>(L_) * S_, 0);
    for (int l = 0; l < L_; ++l) {
      const bool first = l == 0, last = l == L_ - 1;
      // Reuse the previous layer's verdict when layer l's rows, incoming and outgoing transitions are the same.
      if (opt_.prune_strategies && l >= 2 && !last && same_rows(l, l - 1) && same_inter(l, l - 1) &&
          same_inter(l + 1, l)) {
        std::copy(live_.begin() + idx(l - 1, 0), live_.begin() + idx(l, 0), live_.begin() + idx(l, 0));
        continue;
      }
      for (int s = 0; s < S_; ++s)
        live_[idx(l, s)] = std::isfinite(p_.intra_at(l, s)) && std::isfinite(mem_[idx(l, s)]);
      if (!opt_.prune_strategies) continue;
      for (int j = 0; j < S_; ++j) {
        if (!live_[idx(l, j)]) continue;
        for (int k = 0; k < S_; ++k) {
          if (k == j || !live_[idx(l, k)]) continue;
          if (dominates(l, k, j, first, last)) {
            live_[idx(l, j)] = 0;
            break;
          }
        }
      }
    }
  }

  bool dominates(int l, int k, int j, bool first, bool last) const {
    bool strict = false;
    auto le = [&strict](double a, double b) {
      if (a < b) strict = true;
      return a <= b;
    };
    if (!le(mem_[idx(l, k)], mem_[idx(l, j)]) || !le(p_.intra_at(l, k), p_.intra_at(l, j))) return false;
    if (!first)
      for (int i = 0; i < S_; ++i)
        if (!le(p_.inter_at(l, i, k), p_.inter_at(l, i, j))) return false;
    if (!last)
      for (int x = 0; x < S_; ++x)
        if (!le(p_.inter_at(l + 1, k, x), p_.inter_at(l + 1, j, x))) return false;
    return strict || k < j;
  }

  // Backward Viterbi at multiplier lam, restricted to live strategies (and, if min_memory, to each layer's
  // smallest-memory ones). Fills pass.w, pass.plan and its true cost.
  void viterbi(double lam, bool min_memory, Pass& pass) const {
    pass.lam = lam;
    pass.w.assign(static_cast<size_t>(L_) * S_, kInf);
    std::vector<int> next(static_cast<size_t>(L_) * S_, -1);
    auto allowed = [&](int l, int s) {
      if (!live_[idx(l, s)]) return false;
      if (!min_memory) return true;
      return mem_[idx(l, s)] == layer_min_[l];
    };
    std::vector<double> step(S_);  // intra + lam * memory + w of layer l+1
    std::vector<int> ahead;        // the allowed candidates of layer l+1, in order (the others' step is +inf)
    ahead.reserve(S_);
    for (int j = 0; j < S_; ++j)
      if (allowed(L_ - 1, j)) pass.w[idx(L_ - 1, j)] = 0.0;
    for (int l = L_ - 2; l >= 0; --l) {
      ahead.clear();
      for (int x = 0; x < S_; ++x) {
        const bool ok = allowed(l + 1, x);
        step[x] = ok ? p_.intra_at(l + 1, x) + lam * mem_[idx(l + 1, x)] + pass.w[idx(l + 1, x)] : kInf;
        if (ok) ahead.push_back(x);
      }
      for (int j = 0; j < S_; ++j) {
        if (!allowed(l, j)) continue;
        const double* row = p_.inter_row(l + 1, j);
        double best = kInf;
        int arg = -1;
        for (int x : ahead) {  // a skipped x adds +inf: never below best, as in a scan of every x
          const double v = row[x] + step[x];
          if (v < best) {
            best = v;
            arg = x;
          }
        }
        pass.w[idx(l, j)] = best;
        next[idx(l, j)] = arg;
      }
    }
    double best = kInf;
    int arg = -1;
    for (int j = 0; j < S_; ++j) {
      if (!allowed(0, j)) continue;
      const double v = p_.intra_at(0, j) + lam * mem_[idx(0, j)] + pass.w[idx(0, j)];
      if (v < best) {
        best = v;
        arg = j;
      }
    }
    pass.value = best;
    pass.plan.clear();
    pass.time = pass.memory = kInf;
    if (arg < 0 || !std::isfinite(best)) return;
    pass.plan.resize(L_);
    pass.plan[0] = arg;
    for (int l = 1; l < L_; ++l) pass.plan[l] = next[idx(l - 1, pass.plan[l - 1])];
    dp_cost(pass.plan, pass.time, pass.memory);
  }

  // Cost with the DP's (possibly rounded) memory, summed in DP order.
  void dp_cost(const std::vector<int>& c, double& time, double& memory) const {
    time = 0.0;
    memory = 0.0;
    for (int l = 0; l < L_; ++l) {
      if (l > 0) time += p_.inter_at(l, c[l - 1], c[l]);
      time += p_.intra_at(l, c[l]);
      memory += mem_[idx(l, c[l])];
    }
  }

  // Step 2. Returns true when the upper-bound plan is proven optimal. Sets st.method to "unconstrained" when the
  // fastest plan fits and to "infeasible" when no plan has finite time.
  bool dual_search(Stats& st, std::vector<int>& ub_plan, double& ub) {
    Pass a;
    viterbi(0.0, false, a);
    ++st.dual_passes;
    if (a.plan.empty() || !std::isfinite(a.time)) {
      st.method = "infeasible";
      return false;
    }
    if (a.memory <= budget_) {
      ub_plan = a.plan;
      ub = a.time;
      st.method = "unconstrained";
      return false;
    }
    bound0_ = a.w;
    lb_ = a.value - 0.0;
    Pass b;  // smallest-memory plan: fits whenever any plan fits (memory has no transitions)
    viterbi(0.0, true, b);
    ++st.dual_passes;
    if (b.plan.empty() || !(b.memory <= budget_)) return false;  // no UB; the Pareto DP decides
    ub_plan = b.plan;
    ub = b.time;
    std::vector<std::vector<int>> seen = {a.plan, b.plan};  // plans met, for splicing below
    Pass best_dual;  // the pass with the largest dual bound
    for (int it = 0; it < 64; ++it) {
      if (!(a.memory > b.memory)) break;
      double lam = (b.time - a.time) / (a.memory - b.memory);
      if (!(lam >= 0) || !std::isfinite(lam)) break;
      Pass c;
      viterbi(lam, false, c);
      ++st.dual_passes;
      if (c.plan.empty()) break;
      seen.push_back(c.plan);
      const double dual = c.value - lam * budget_;
      if (dual > lb_ || best_dual.w.empty()) {
        if (dual > lb_) lb_ = dual;
        best_dual = c;
      }
      if (lb_ > cut_) return false;  // no plan within the cutoff: solve() says so
      if (c.memory <= budget_ && c.time < ub) {
        ub = c.time;
        ub_plan = c.plan;
      }
      if (ub <= lb_ + 1e-13 * std::fabs(ub)) return true;
      const double line = a.time + lam * a.memory;
      if (!(c.value < line - 1e-12 * std::fabs(line))) break;  // lam is the dual optimum
      if (c.memory > budget_)
        a = std::move(c);
      else
        b = std::move(c);
    }
    if (!best_dual.w.empty()) {
      lam_ = best_dual.lam;
      bound_lam_ = std::move(best_dual.w);
    }
    splice(seen, ub, ub_plan);
    return ub <= lb_ + 1e-13 * std::fabs(ub);
  }

  // A better upper bound from the plans the dual search met: the optimum is often the head of one and the tail of
  // another (e.g. the fast plan for some layers, the small one for the rest). Tries every cut of every ordered
  // pair, O(P^2 L) with prefix sums, and keeps the best that truly fits (recomputed exactly).
  void splice(const std::vector<std::vector<int>>& plans, double& ub, std::vector<int>& ub_plan) const {
    const size_t n = plans.size();
    if (n < 2 || L_ < 2) return;
    const size_t stride = static_cast<size_t>(L_) + 1;
    std::vector<double> pre_t(n * stride), pre_m(n * stride), suf_t(n * stride), suf_m(n * stride);
    for (size_t p = 0; p < n; ++p) {
      const std::vector<int>& c = plans[p];
      double* pt = &pre_t[p * stride];
      double* pm = &pre_m[p * stride];
      double* st = &suf_t[p * stride];
      double* sm = &suf_m[p * stride];
      pt[0] = pm[0] = 0.0;
      for (int l = 0; l < L_; ++l) {
        pt[l + 1] = pt[l] + (l > 0 ? p_.inter_at(l, c[l - 1], c[l]) : 0.0) + p_.intra_at(l, c[l]);
        pm[l + 1] = pm[l] + mem_[idx(l, c[l])];
      }
      st[L_] = sm[L_] = 0.0;
      for (int l = L_ - 1; l >= 0; --l) {
        st[l] = st[l + 1] + p_.intra_at(l, c[l]) + (l + 1 < L_ ? p_.inter_at(l + 1, c[l], c[l + 1]) : 0.0);
        sm[l] = sm[l + 1] + mem_[idx(l, c[l])];
      }
    }
    const double slack = 1e-9 * (std::fabs(budget_) + 1.0);
    double best = ub;
    size_t bp = 0, bq = 0;
    int bk = -1;
    for (size_t p = 0; p < n; ++p)
      for (size_t q = 0; q < n; ++q) {
        if (p == q) continue;
        for (int k = 1; k < L_; ++k) {
          const double m = pre_m[p * stride + k] + suf_m[q * stride + k];
          if (m > budget_ + slack) continue;
          const double t =
              pre_t[p * stride + k] + p_.inter_at(k, plans[p][k - 1], plans[q][k]) + suf_t[q * stride + k];
          if (t < best) {
            best = t;
            bp = p;
            bq = q;
            bk = k;
          }
        }
      }
    if (bk < 0) return;
    std::vector<int> plan(plans[bp].begin(), plans[bp].begin() + bk);
    plan.insert(plan.end(), plans[bq].begin() + bk, plans[bq].end());
    double t, m;
    dp_cost(plan, t, m);
    if (m <= budget_ && t < ub) {
      ub = t;
      ub_plan = std::move(plan);
    }
  }

  // Lower bound on the time still to come after (l, j) with m MiB used.
  double bound(int l, int j, double m) const {
    if (bound0_.empty()) return 0.0;
    double b = bound0_[idx(l, j)];
    if (!bound_lam_.empty()) b = std::max(b, bound_lam_[idx(l, j)] - lam_ * (budget_ - m));
    return b;
  }

  // delta_[k*S+j] = max over next strategies x of inter(l+1, k, x) - inter(l+1, j, x): the most that ending layer l
  // in k instead of j can add to any continuation (+inf: k cannot stand in for j).
  // Returns false (no pruning) when the O(S^3) table would cost more than the pruning can save.
  bool transition_deltas(int l, size_t points) {
    const int n = l + 1;
    if (delta_layer_ >= 0 && same_inter(n, delta_layer_ + 1) &&
        std::equal(live_.begin() + idx(n, 0), live_.begin() + idx(n, 0) + S_, live_.begin() + idx(delta_layer_ + 1, 0))) {
      delta_layer_ = l;
      return true;
    }
    if (points * 8 < static_cast<size_t>(S_) * S_) return false;
    delta_layer_ = l;
    delta_.assign(static_cast<size_t>(S_) * S_, kInf);
    for (int k = 0; k < S_; ++k) {
      const double* rk = p_.inter_row(n, k);
      for (int j = 0; j < S_; ++j) {
        if (j == k) continue;
        const double* rj = p_.inter_row(n, j);
        double d = -kInf;
        for (int x = 0; x < S_ && d < kInf; ++x) {
          if (!live_[idx(n, x)] || rk[x] == rj[x]) {
            d = std::max(d, 0.0);
            continue;
          }
          d = std::max(d, rk[x] - rj[x]);  // inf - finite = inf; finite - inf = -inf
        }
        delta_[static_cast<size_t>(k) * S_ + j] = d;
      }
    }
    return true;
  }

  // Drops a partial plan (m, t) ending in j when a live one (m', t') ending in k has m' <= m and t' + delta(k, j) <=
  // t: every completion of the first is matched, no slower, by the same completion of the second. Points are
  // removed one at a time and only by points still present, so every removed point has a surviving dominator.
  size_t prune_across(int l, std::vector<Point>& pts, std::vector<int32_t>& off) {
    if (l >= L_ - 1 || pts.empty() || !transition_deltas(l, pts.size())) return 0;
    std::vector<char> dead(pts.size(), 0);
    for (int j = 0; j < S_; ++j) {
      const int32_t jb = off[j], je = off[j + 1];
      if (jb == je) continue;
      for (int k = 0; k < S_; ++k) {
        const double d = k == j ? kInf : delta_[static_cast<size_t>(k) * S_ + j];
        if (!(d < kInf) || off[k] == off[k + 1]) continue;
        int32_t q = off[k] - 1;  // last live point of front k with memory <= current point's memory
        int32_t scan = off[k];
        for (int32_t p = jb; p < je; ++p) {
          if (dead[p]) continue;
          while (scan < off[k + 1] && pts[scan].m <= pts[p].m) {
            if (!dead[scan]) q = scan;
            ++scan;
          }
          if (q >= off[k] && pts[q].t + d <= pts[p].t) dead[p] = 1;
        }
      }
    }
    size_t w = 0;
    std::vector<int32_t> new_off(S_ + 1, 0);
    for (int j = 0; j < S_; ++j) {
      new_off[j] = static_cast<int32_t>(w);
      for (int32_t p = off[j]; p < off[j + 1]; ++p)
        if (!dead[p]) pts[w++] = pts[p];
    }
    new_off[S_] = static_cast<int32_t>(w);
    const size_t removed = pts.size() - w;
    pts.resize(w);
    off = std::move(new_off);
    return removed;
  }

  // Step 3. Returns true with the plan when a plan strictly faster than ub exists.
  bool pareto(Stats& st, double ub, std::vector<int>& plan) {
    const double slack = 1e-12 * (std::fabs(budget_) + 1.0);
    const bool bounded = std::isfinite(ub) && !bound0_.empty();
    std::vector<std::vector<Point>> pts(L_);
    std::vector<std::vector<int32_t>> off(L_, std::vector<int32_t>(S_ + 1, 0));
    auto record = [&](int l) {
      for (int j = 0; j < S_; ++j) st.max_front = std::max<long long>(st.max_front, off[l][j + 1] - off[l][j]);
      st.front_points += static_cast<long long>(pts[l].size());
    };
    for (int j = 0; j < S_; ++j) {
      off[0][j] = static_cast<int32_t>(pts[0].size());
      if (!live_[idx(0, j)]) continue;
      const double m = mem_[idx(0, j)], t = p_.intra_at(0, j);
      if (m + suffix_min_mem_[1] > budget_ + slack) continue;
      if (bounded && t + bound(0, j, m) >= ub) continue;
      pts[0].push_back({m, t, -1, -1});
    }
    off[0][S_] = static_cast<int32_t>(pts[0].size());
    if (opt_.cross_prune) st.cross_pruned += prune_across(0, pts[0], off[0]);
    record(0);
    std::vector<Cand> merged;
    for (int l = 1; l < L_; ++l) {
      merged.clear();
      for (int i = 0; i < S_; ++i)
        for (int32_t q = off[l - 1][i]; q < off[l - 1][i + 1]; ++q)
          merged.push_back({pts[l - 1][q].m, pts[l - 1][q].t, i, q});
      std::sort(merged.begin(), merged.end(),
                [](const Cand& x, const Cand& y) { return x.m < y.m || (x.m == y.m && x.t < y.t); });
      std::vector<Point>& out = pts[l];
      const double limit = budget_ + (l == L_ - 1 ? 0.0 : slack) - suffix_min_mem_[l + 1];
      const double* into = p_.inter_row(l, 0);  // layer l's [S][S] transitions
      for (int j = 0; j < S_; ++j) {
        off[l][j] = static_cast<int32_t>(out.size());
        if (!live_[idx(l, j)]) continue;
        const double mj = mem_[idx(l, j)], tj = p_.intra_at(l, j);
        const size_t first = out.size();
        double best = kInf;
        for (const Cand& c : merged) {
          const double m = c.m + mj;
          if (m > limit) break;
          const double t = c.t + into[static_cast<size_t>(c.s) * S_ + j] + tj;
          if (!(t < best)) continue;
          best = t;
          if (bounded && t + bound(l, j, m) >= ub) continue;
          if (out.size() > first && out.back().m == m)
            out.back() = {m, t, c.s, c.idx};
          else
            out.push_back({m, t, c.s, c.idx});
        }
      }
      off[l][S_] = static_cast<int32_t>(out.size());
      if (opt_.cross_prune) st.cross_pruned += prune_across(l, out, off[l]);
      record(l);
      if (out.empty()) return false;
    }
    // Cheapest point of the last layer (its memory was checked against the budget exactly).
    const std::vector<Point>& last = pts[L_ - 1];
    double best = ub;
    int32_t arg = -1;
    int arg_s = -1;
    for (int j = 0; j < S_; ++j)
      for (int32_t q = off[L_ - 1][j]; q < off[L_ - 1][j + 1]; ++q)
        if (last[q].t < best && last[q].m <= budget_) {
          best = last[q].t;
          arg = q;
          arg_s = j;
        }
    if (arg < 0) return false;
    plan.assign(L_, -1);
    int s = arg_s;
    int32_t q = arg;
    for (int l = L_ - 1; l >= 0; --l) {
      plan[l] = s;
      const Point& pt = pts[l][q];
      s = pt.prev_s;
      q = pt.prev_idx;
    }
    return true;
  }

  StageSolution finish(const std::vector<int>& plan, Stats& st, const char* method) const {
    StageSolution out;
    out.feasible = true;
    out.choice = plan;
    plan_cost(p_, plan, out.time, out.memory);
    st.method = method;
    return out;
  }
  StageSolution infeasible(Stats& st) const {
    st.method = "infeasible";
    return StageSolution();
  }
  StageSolution above(Stats& st) const {
    st.method = "above_cutoff";
    StageSolution out;
    out.above_cutoff = true;
    return out;
  }

  const StageProblem& p_;
  const Options opt_;
  const int L_, S_;
  const double budget_;
  const double cut_;    // Options::cutoff with a relative slack of 1e-9 (sums in another order)
  double lb_ = -kInf;  // the dual bound of step 2
  std::vector<double> mem_;
  std::vector<char> live_;
  std::vector<double> layer_min_, suffix_min_mem_;
  std::vector<double> bound0_, bound_lam_;
  std::vector<double> delta_;
  int delta_layer_ = -1;
  double lam_ = 0.0;
};

inline StageSolution solve(const StageProblem& p, const Options& o = Options(), Stats* stats = nullptr) {
  validate(p);
  StageSolver solver(p, o);
  return solver.solve(stats);
}

// Runs work(0) .. work(n - 1) on `threads` std::threads (0: one per hardware thread), this one included.
template <class Work>
inline void run_parallel(size_t n, unsigned threads, Work work) {
  std::atomic<size_t> next{0};
  auto loop = [&]() {
    for (;;) {
      const size_t i = next.fetch_add(1);
      if (i >= n) return;
      work(i);
    }
  };
  unsigned count = threads ? threads : std::max(1u, std::thread::hardware_concurrency());
  count = static_cast<unsigned>(std::min<size_t>(count, std::max<size_t>(n, 1)));
  std::vector<std::thread> pool;
  for (unsigned k = 1; k < count; ++k) pool.emplace_back(loop);
  loop();
  for (std::thread& t : pool) t.join();
}

// Solves independent problems on `threads` std::threads (0: one per hardware thread). A problem that fails
// validation makes the call throw std::invalid_argument with "problems[i]: " before the message.
inline std::vector<StageSolution> solve_many(const std::vector<StageProblem>& problems, const Options& o,
                                             unsigned threads) {
  const size_t n = problems.size();
  std::vector<StageSolution> out(n);
  std::vector<std::string> errors(n);
  std::vector<char> failed(n, 0);
  run_parallel(n, threads, [&](size_t i) {
    try {
      out[i] = solve(problems[i], o);
    } catch (const std::exception& e) {
      errors[i] = e.what();
      failed[i] = 1;
    }
  });
  for (size_t i = 0; i < n; ++i)
    if (failed[i]) throw std::invalid_argument("problems[" + std::to_string(i) + "]: " + errors[i]);
  return out;
}

}  // namespace dp
}  // namespace galva
