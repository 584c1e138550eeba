// galva-search: one pipeline stage's transient levels, reduced, bounded and solved (the stage DP of stage_dp.hpp
// under each level), with the solutions kept for reuse between tasks.
//
// Transients (a ZeRO-3 layer's gathered parameters, a checkpointed layer's recomputation) are held by one layer at a
// time, so a plan's peak adds the *largest* transient of its layers. Level tau forbids the candidates whose transient
// exceeds tau and lowers the budget by tau; the fastest plan over the levels (the lowest level of equal ones) is the
// stage's optimum: exact. Per level only the candidates that no other of the same transition class (identical
// transitions from and to every candidate at every layer) matches or beats in time and memory at every layer are kept
// (swapping a beaten candidate for its beater keeps every transition, is no slower and uses no more memory), and the
// levels of a stage are solved in order of a Lagrangian lower bound (layers apart, transitions >= 0) until none left
// can beat the best found. galva_search/stages.py holds the Python statement of the same rules (the reference the
// tests compare this with); this file only makes them cheap (no per-level arrays built in Python).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "stage_dp.hpp"

namespace galva {
namespace dp {

// Multipliers of the level bound, seconds per MiB: 0 and 10^-9 .. 10^1 in quarter decades (any value gives a valid
// bound; they only order the levels).
inline const std::vector<double>& bound_lambdas() {
  static const std::vector<double> lams = [] {
    std::vector<double> v{0.0};
    for (int k = 0; k <= 40; ++k) v.push_back(std::pow(10.0, -9.0 + 0.25 * k));
    return v;
  }();
  return lams;
}

struct Solved {
  double budget;
  StageSolution solution;  // in the stage problem's candidate numbers
  double cutoff;           // solved under Options::cutoff (what an above_cutoff solution says: nothing within it)
};

struct Level {
  double tau = 0.0;
  std::vector<int> columns;              // candidates of the stage problem kept at this level
  std::vector<double> priced;            // per multiplier: sum over layers of the least time + lam * memory
  StageProblem reduced;                  // built when first solved (most levels never are)
  std::vector<Solved> solved;            // in the order solved
};

class StageLevels {
 public:
  // intra/memory/transient [L][S], inter [L][S][S] or, with ``block`` (one entry per layer), its distinct [S][S]
  // blocks (stage_dp.hpp's StageProblem), row-major. Throws on bad values.
  StageLevels(int layers, int strategies, std::vector<double> intra, std::vector<double> memory,
              std::vector<double> inter, std::vector<double> transient, std::vector<int> block = {})
      : L_(layers), S_(strategies) {
    p_.layers = layers;
    p_.strategies = strategies;
    p_.intra = std::move(intra);
    p_.memory = std::move(memory);
    p_.inter = std::move(inter);
    p_.block = std::move(block);
    p_.budget = 0.0;
    // layers of one type share their transition block: gather, check and compare each distinct block once
    const size_t ss = static_cast<size_t>(S_) * S_;
    same_block_.assign(L_, 0);
    if (p_.block.empty() ? p_.inter.size() == ss * L_ : blocks_in_range())  // else validate() says what is wrong
      for (int l = 1; l < L_; ++l)
        same_block_[l] = p_.block_of(l) == p_.block_of(l - 1) ||
                         std::memcmp(p_.inter_row(l, 0), p_.inter_row(l - 1, 0), ss * sizeof(double)) == 0;
    validate(p_, &same_block_);
    if (transient.size() != p_.intra.size()) throw std::invalid_argument("transient must have layers*strategies entries");
    for (int l = 0; l < L_; ++l)
      for (int s = 0; s < S_; ++s) check_value(transient[idx(l, s)], "transient", l, s, -1);
    transient_ = std::move(transient);
    // and their rows (time, memory, transient): a level's bound prices each distinct run of rows once
    same_row_.assign(L_, 0);
    const size_t row = static_cast<size_t>(S_) * sizeof(double);
    for (int l = 1; l < L_; ++l)
      same_row_[l] = std::memcmp(&p_.intra[idx(l, 0)], &p_.intra[idx(l - 1, 0)], row) == 0 &&
                     std::memcmp(&p_.memory[idx(l, 0)], &p_.memory[idx(l - 1, 0)], row) == 0 &&
                     std::memcmp(&transient_[idx(l, 0)], &transient_[idx(l - 1, 0)], row) == 0;
    classify();
    build_levels();
  }

  int layers() const { return L_; }
  int strategies() const { return S_; }
  const std::vector<Level>& levels() const { return levels_; }
  const std::vector<int>& classes() const { return class_; }

  // Lower bound on the time of level i's plans under the stage budget ``budget`` (its own budget is budget - tau).
  double bound(size_t i, double budget) const {
    const Level& lv = levels_[i];
    const std::vector<double>& lams = bound_lambdas();
    const double b = budget - lv.tau;
    double best = -kInf;
    for (size_t k = 0; k < lams.size(); ++k) {
      const double v = lv.priced[k] - lams[k] * b;
      if (std::isnan(v)) return v;
      best = std::max(best, v);
    }
    return best;
  }

  // stages.py's _cached: a solution of level i found under ``budget`` or one that answers it (found, solution), for
  // a stage to which a plan slower than ``cutoff`` is of no use (an above-cutoff answer: found, no solution).
  std::pair<bool, const StageSolution*> cached(size_t i, double budget, double cutoff) const {
    for (const auto& [solved_budget, sol, solved_cutoff] : levels_[i].solved) {
      if (sol.above_cutoff) {  // nothing within solved_cutoff: nor under less memory, nor within less time
        if (solved_budget >= budget && cutoff <= solved_cutoff) return {true, nullptr};
        continue;
      }
      if (!sol.feasible && solved_budget >= budget) return {true, nullptr};
      if (sol.feasible && solved_budget >= budget && sol.memory <= budget) return {true, &sol};
      if (solved_budget == budget) return {true, sol.feasible ? &sol : nullptr};
    }
    return {false, nullptr};
  }

  // Level i's reduced problem (built when asked, until release()).
  const StageProblem& reduced(size_t i) {
    Level& lv = levels_[i];
    if (lv.reduced.strategies == 0 && !lv.columns.empty()) {
      const std::vector<int>& c = lv.columns;
      const int n = static_cast<int>(c.size());
      StageProblem& r = lv.reduced;
      r.layers = L_;
      r.strategies = n;
      r.intra.resize(static_cast<size_t>(L_) * n);
      r.memory.resize(static_cast<size_t>(L_) * n);
      r.block.resize(L_);
      const size_t nn = static_cast<size_t>(n) * n;
      std::unordered_map<size_t, int> reduced_of;  // the stage's block -> the reduced problem's
      for (int l = 0; l < L_; ++l) {
        for (int a = 0; a < n; ++a) {
          r.intra[static_cast<size_t>(l) * n + a] = level_intra(l, c[a], lv.tau);
          r.memory[static_cast<size_t>(l) * n + a] = p_.memory_at(l, c[a]);
        }
        if (l > 0 && same_block_[l]) {  // each distinct block is reduced once
          r.block[l] = r.block[l - 1];
          continue;
        }
        const auto [at, fresh] = reduced_of.emplace(p_.block_of(l), static_cast<int>(reduced_of.size()));
        r.block[l] = at->second;
        if (!fresh) continue;
        r.inter.resize(r.inter.size() + nn);
        double* out = &r.inter[r.inter.size() - nn];
        for (int a = 0; a < n; ++a) {
          const double* row = p_.inter_row(l, c[a]);
          for (int b = 0; b < n; ++b) out[static_cast<size_t>(a) * n + b] = row[c[b]];
        }
      }
    }
    return lv.reduced;
  }

  // Frees level i's reduced problem (most levels are solved once; a later budget rebuilds it).
  void release(size_t i) { levels_[i].reduced = StageProblem(); }

  void record(size_t i, double budget, StageSolution sol, double cutoff) {
    Level& lv = levels_[i];
    for (int& s : sol.choice) s = lv.columns[static_cast<size_t>(s)];
    lv.solved.push_back({budget, std::move(sol), cutoff});
  }

 private:
  size_t idx(int l, int s) const { return static_cast<size_t>(l) * S_ + s; }
  bool blocks_in_range() const {
    const size_t ss = static_cast<size_t>(S_) * S_;
    if (p_.block.size() != static_cast<size_t>(L_) || ss == 0 || p_.inter.size() % ss != 0) return false;
    for (int b : p_.block)
      if (b < 0 || static_cast<size_t>(b) >= p_.inter.size() / ss) return false;
    return true;
  }
  bool finite_intra(int l, int s) const { return std::isfinite(p_.intra_at(l, s)); }
  double level_intra(int l, int s, double tau) const {  // +inf where the candidate's transient exceeds tau
    return multi_ && !(transient_[idx(l, s)] <= tau) ? kInf : p_.intra_at(l, s);
  }

  // class_[s]: shared by exactly the candidates with the same transitions from and to every candidate at every layer
  // (numbered in order of first appearance, as stages.transition_classes).
  void classify() {
    class_.assign(S_, -1);
    std::vector<uint64_t> into(S_, 1469598103934665603ull), from(S_, 1469598103934665603ull), hash(S_);
    auto mix = [](uint64_t h, double v) {
      uint64_t bits;
      std::memcpy(&bits, &v, sizeof bits);
      return (h ^ bits) * 1099511628211ull;
    };
    for (int l = 0; l < L_; ++l) {
      if (same_block_[l]) continue;  // a repeated block adds nothing to tell candidates apart
      for (int i = 0; i < S_; ++i)
        for (int j = 0; j < S_; ++j) {
          const double v = p_.inter_at(l, i, j);
          into[j] = mix(into[j], v);
          from[i] = mix(from[i], v);
        }
    }
    for (int s = 0; s < S_; ++s) hash[s] = into[s] ^ (from[s] * 0x9e3779b97f4a7c15ull);
    std::unordered_map<uint64_t, std::vector<int>> firsts;  // hash -> class representatives
    int next = 0;
    for (int s = 0; s < S_; ++s) {
      std::vector<int>& reps = firsts[hash[s]];
      for (int r : reps)
        if (same_transitions(r, s)) {
          class_[s] = class_[r];
          break;
        }
      if (class_[s] < 0) {
        class_[s] = next++;
        reps.push_back(s);
      }
    }
    members_.assign(next, {});
    for (int s = 0; s < S_; ++s) members_[class_[s]].push_back(s);
  }

  bool same_transitions(int a, int b) const {
    for (int l = 0; l < L_; ++l) {
      if (same_block_[l]) continue;
      for (int x = 0; x < S_; ++x) {
        const double* ra = p_.inter_row(l, a);
        const double* rb = p_.inter_row(l, b);
        if (std::memcmp(&ra[x], &rb[x], sizeof(double)) != 0) return false;  // bytes, as tobytes() compares
        const double ia = p_.inter_at(l, x, a), ib = p_.inter_at(l, x, b);
        if (std::memcmp(&ia, &ib, sizeof(double)) != 0) return false;
      }
    }
    return true;
  }

  // beaten[b]: some candidate a with ``allowed(a)`` beats b (stages.undominated_beats) under the times t(l, s).
  template <class Time, class Allowed>
  std::vector<char> beaten(Time t, Allowed allowed) const {
    std::vector<char> out(S_, 0);
    std::vector<char> live_any(S_, 0);
    for (int s = 0; s < S_; ++s)
      for (int l = 0; l < L_ && !live_any[s]; ++l)
        live_any[s] = std::isfinite(t(l, s)) && std::isfinite(p_.memory_at(l, s));
    for (const std::vector<int>& group : members_) {
      if (group.size() < 2) continue;
      for (int b : group) {
        for (int a : group) {
          if (a == b || !live_any[a] || !allowed(a)) continue;
          bool le = true, eq = true;
          for (int l = 0; l < L_ && le; ++l) {
            if (l > 0 && same_row_[l]) continue;  // the same verdict as layer l - 1
            const bool la = std::isfinite(t(l, a)) && std::isfinite(p_.memory_at(l, a));
            const bool lb = std::isfinite(t(l, b)) && std::isfinite(p_.memory_at(l, b));
            const double ta = la ? t(l, a) : kInf, tb = lb ? t(l, b) : kInf;
            const double ma = la ? p_.memory_at(l, a) : kInf, mb = lb ? p_.memory_at(l, b) : kInf;
            le = ta <= tb && ma <= mb;
            eq = eq && ta == tb && ma == mb;
          }
          if (le && (!eq || a < b)) {
            out[b] = 1;
            break;
          }
        }
      }
    }
    return out;
  }

  // stages.StageSolver.levels: the levels of the stage, in order of tau, each with its kept candidates.
  void build_levels() {
    std::vector<double> values;
    for (int l = 0; l < L_; ++l)
      for (int s = 0; s < S_; ++s)
        if (finite_intra(l, s)) values.push_back(transient_[idx(l, s)]);
    std::sort(values.begin(), values.end());
    values.erase(std::unique(values.begin(), values.end()), values.end());
    auto plain = [this](int l, int s) { return p_.intra_at(l, s); };
    auto any = [](int) { return true; };
    if (values.size() <= 1) {
      multi_ = false;
      Level lv;
      lv.tau = values.empty() ? 0.0 : values[0];
      const std::vector<char> out = beaten(plain, any);
      for (int s = 0; s < S_; ++s)
        if (!out[s] && live_somewhere(s, lv.tau)) lv.columns.push_back(s);
      if (lv.columns.empty() && S_ > 0) lv.columns.push_back(0);  // none: one forbidden column says so
      add(std::move(lv));
      return;
    }
    multi_ = true;
    bool uniform = true;
    for (int l = 1; l < L_ && uniform; ++l)
      uniform = std::memcmp(&transient_[idx(l, 0)], &transient_[0], sizeof(double) * S_) == 0;
    if (uniform) {  // a candidate is allowed at every layer or at none: the whole stage's verdicts hold at each level
      std::vector<char> runs(S_, 0);
      for (int s = 0; s < S_; ++s)
        for (int l = 0; l < L_ && !runs[s]; ++l) runs[s] = finite_intra(l, s);
      std::vector<std::vector<int>> beaters(S_);  // beaters[b]: candidates that beat b over the whole stage
      for (const std::vector<int>& group : members_) {
        if (group.size() < 2) continue;
        for (int b : group)
          for (int a : group)
            if (a != b && beats_whole(a, b)) beaters[b].push_back(a);
      }
      for (double tau : values) {
        Level lv;
        lv.tau = tau;
        double top = -kInf;
        for (int s = 0; s < S_; ++s) {
          if (!(transient_[s] <= tau) || !runs[s]) continue;
          bool out = false;
          for (int a : beaters[s]) out = out || (transient_[a] <= tau && runs[a]);
          if (out) continue;
          lv.columns.push_back(s);
          top = std::max(top, transient_[s]);
        }
        if (lv.columns.empty() || top < tau) continue;  // its plans are a lower level's, whose budget is larger
        add(std::move(lv));
      }
      return;
    }
    for (double tau : values) {
      Level lv;
      lv.tau = tau;
      auto masked = [this, tau](int l, int s) { return transient_[idx(l, s)] <= tau ? p_.intra_at(l, s) : kInf; };
      const std::vector<char> out = beaten(masked, any);
      for (int s = 0; s < S_; ++s)
        if (!out[s] && live_somewhere(s, tau)) lv.columns.push_back(s);
      if (lv.columns.empty() && S_ > 0) lv.columns.push_back(0);  // none: one forbidden column says so
      double top = -kInf;
      for (int s : lv.columns)
        for (int l = 0; l < L_; ++l)
          if (std::isfinite(masked(l, s))) top = std::max(top, transient_[idx(l, s)]);
      if (top < tau) continue;
      add(std::move(lv));
    }
  }

  bool live_somewhere(int s, double tau) const {
    for (int l = 0; l < L_; ++l)
      if (std::isfinite(level_intra(l, s, tau)) && std::isfinite(p_.memory_at(l, s))) return true;
    return false;
  }

  bool beats_whole(int a, int b) const {
    bool any_live = false, eq = true;
    for (int l = 0; l < L_; ++l) {
      if (l > 0 && same_row_[l]) continue;  // the same verdict as layer l - 1
      const bool la = finite_intra(l, a) && std::isfinite(p_.memory_at(l, a));
      const bool lb = finite_intra(l, b) && std::isfinite(p_.memory_at(l, b));
      any_live = any_live || la;
      const double ta = la ? p_.intra_at(l, a) : kInf, tb = lb ? p_.intra_at(l, b) : kInf;
      const double ma = la ? p_.memory_at(l, a) : kInf, mb = lb ? p_.memory_at(l, b) : kInf;
      if (!(ta <= tb && ma <= mb)) return false;
      eq = eq && ta == tb && ma == mb;
    }
    return any_live && (!eq || a < b);
  }

  void add(Level lv) {
    const std::vector<double>& lams = bound_lambdas();
    lv.priced.assign(lams.size(), 0.0);
    for (size_t k = 0; k < lams.size(); ++k) {
      double sum = 0.0, least = kInf;
      for (int l = 0; l < L_; ++l) {
        if (l == 0 || !same_row_[l]) {  // else the same rows as layer l - 1: the same least value
          least = kInf;
          for (int s : lv.columns) {
            const double t = level_intra(l, s, lv.tau), m = p_.memory_at(l, s);
            if (std::isfinite(t) && std::isfinite(m)) least = std::min(least, t + lams[k] * m);
          }
        }
        sum += least;
      }
      lv.priced[k] = sum;
    }
    levels_.push_back(std::move(lv));
  }

  const int L_, S_;
  StageProblem p_;
  std::vector<double> transient_;
  std::vector<char> same_block_;  // layer l's transition block equals layer l - 1's
  std::vector<char> same_row_;    // layer l's time, memory and transient rows equal layer l - 1's
  std::vector<int> class_;
  std::vector<std::vector<int>> members_;
  std::vector<Level> levels_;
  bool multi_ = false;  // levels mask candidates by transient (false: one level, nothing masked)
};

struct LevelCounts {
  long long solved = 0;  // DPs run
  long long reused = 0;  // level solutions found in the cache
  long long above = 0;   // DPs that stopped at the cutoff
};

// The best plan of each stage (stage, its budget) over its levels: rounds in which every stage solves the next of
// its levels in bound order that the cache cannot answer, all of a round's DPs on ``threads`` threads, until no level
// left can beat its stage's best (the fastest; the lowest level of equal ones). With ``cutoffs`` a level's DP is told
// the best time its stages already have (Options::cutoff): a level that cannot reach it is answered without its
// Pareto DP, and one that can still gets its exact optimum. ``best_level`` gets the level (-1: nothing fits).
inline std::vector<StageSolution> solve_stages(const std::vector<std::pair<StageLevels*, double>>& stages,
                                               const Options& o, unsigned threads, LevelCounts& counts,
                                               bool cutoffs = true, std::vector<int>* best_level = nullptr) {
  struct Track {
    std::vector<size_t> order;
    std::vector<double> bounds;
    size_t next = 0;
    double best_time = kInf;
    long best = -1;
  };
  std::vector<Track> tracks(stages.size());
  for (size_t n = 0; n < stages.size(); ++n) {
    const auto& [sl, budget] = stages[n];
    Track& tr = tracks[n];
    const size_t k = sl->levels().size();
    tr.bounds.resize(k);
    for (size_t i = 0; i < k; ++i) tr.bounds[i] = sl->bound(i, budget);
    tr.order.resize(k);
    for (size_t i = 0; i < k; ++i) tr.order[i] = i;
    std::stable_sort(tr.order.begin(), tr.order.end(),
                     [&tr](size_t a, size_t b) { return tr.bounds[a] < tr.bounds[b]; });
  }
  for (;;) {
    std::vector<std::tuple<StageLevels*, size_t, double>> pending;
    std::vector<double> cutoff;  // per pending DP: the slowest best time of the stages asking for it
    std::map<std::tuple<StageLevels*, size_t, double>, size_t> seen;
    for (size_t n = 0; n < stages.size(); ++n) {
      const auto& [sl, budget] = stages[n];
      Track& tr = tracks[n];
      while (tr.next < tr.order.size()) {
        const size_t i = tr.order[tr.next];
        if (tr.bounds[i] > tr.best_time + 1e-9 * std::fabs(tr.best_time)) {  // this level and the rest cannot win
          tr.next = tr.order.size();
          break;
        }
        const double level_budget = budget - sl->levels()[i].tau;
        const auto [found, sol] = sl->cached(i, level_budget, tr.best_time);
        if (!found) {
          const auto key = std::make_tuple(sl, i, level_budget);
          const auto [at, fresh] = seen.emplace(key, pending.size());
          if (fresh) {
            pending.push_back(key);
            cutoff.push_back(cutoffs ? tr.best_time : kInf);
          } else {
            cutoff[at->second] = std::max(cutoff[at->second], cutoffs ? tr.best_time : kInf);
          }
          break;
        }
        ++counts.reused;
        ++tr.next;
        if (sol && (sol->time < tr.best_time || (sol->time == tr.best_time && static_cast<long>(i) < tr.best))) {
          tr.best_time = sol->time;
          tr.best = static_cast<long>(i);
        }
      }
    }
    if (pending.empty()) break;
    std::vector<const StageProblem*> problems;
    for (auto& [sl, i, level_budget] : pending) problems.push_back(&sl->reduced(i));
    std::vector<StageSolution> out(pending.size());
    run_parallel(pending.size(), threads, [&](size_t k) {
      Options own = o;
      own.cutoff = cutoff[k];
      StageSolver solver(*problems[k], own, std::get<2>(pending[k]));
      out[k] = solver.solve(nullptr);
    });
    counts.solved += static_cast<long long>(pending.size());
    for (size_t k = 0; k < pending.size(); ++k) {
      auto& [sl, i, level_budget] = pending[k];
      counts.above += out[k].above_cutoff;
      sl->record(i, level_budget, std::move(out[k]), cutoff[k]);
      sl->release(i);
    }
  }
  std::vector<StageSolution> result(stages.size());
  if (best_level) best_level->assign(stages.size(), -1);
  for (size_t n = 0; n < stages.size(); ++n) {
    const Track& tr = tracks[n];
    if (tr.best < 0) continue;
    const auto& [sl, budget] = stages[n];
    const auto [found, sol] = sl->cached(static_cast<size_t>(tr.best), budget - sl->levels()[tr.best].tau, tr.best_time);
    if (found && sol) result[n] = *sol;
    if (best_level) (*best_level)[n] = static_cast<int>(tr.best);
  }
  return result;
}

}  // namespace dp
}  // namespace galva
