/* Index builders for the dataset pipeline (pybind11 module `helpers_cpp`).
 *
 * These loops run over every token / document of a split at start-up, so they live in C++.
 * Their outputs must equal Megatron-LM's for the same inputs (same sample order), see COMPAT.md 4.3.
 */
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <random>
#include <set>
#include <stdexcept>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

namespace py = pybind11;

// Greedy blend: sample k goes to the dataset whose share is furthest below weight * max(k, 1).
void build_blending_indices(py::array_t<int16_t> &dataset_index, py::array_t<int64_t> &dataset_sample_index,
                            const py::array_t<double> &weights, const int32_t num_datasets, const int64_t size,
                            const bool verbose) {
  auto index = dataset_index.mutable_unchecked<1>();
  auto sample_index = dataset_sample_index.mutable_unchecked<1>();
  auto w = weights.unchecked<1>();
  std::vector<int64_t> taken(num_datasets, 0);
  for (int64_t k = 0; k < size; ++k) {
    const double k_double = std::max(static_cast<double>(k), 1.0);
    int64_t best = 0;
    double best_error = w(0) * k_double - static_cast<double>(taken[0]);
    for (int64_t d = 1; d < num_datasets; ++d) {
      const double error = w(d) * k_double - static_cast<double>(taken[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    index(k) = static_cast<int16_t>(best);
    sample_index(k) = taken[best];
    taken[best] += 1;
  }
  if (verbose) {
    std::cout << " > sample ratios:" << std::endl;
    for (int64_t d = 0; d < num_datasets; ++d) {
      std::cout << "   dataset " << d << ", input: " << w(d)
                << ", achieved: " << static_cast<double>(taken[d]) / static_cast<double>(std::max<int64_t>(size, 1))
                << std::endl;
    }
  }
}

// Same greedy rule, but draws exactly sizes[d] samples from every dataset.
void build_exhaustive_blending_indices(py::array_t<int16_t> &dataset_index,
                                       py::array_t<int64_t> &dataset_sample_index,
                                       const py::array_t<int64_t> &sizes, const int32_t num_datasets) {
  auto index = dataset_index.mutable_unchecked<1>();
  auto sample_index = dataset_sample_index.mutable_unchecked<1>();
  auto s = sizes.unchecked<1>();
  int64_t total = 0;
  std::vector<int64_t> taken(num_datasets, 0);
  std::set<int32_t> unspent;
  for (int32_t d = 0; d < num_datasets; ++d) {
    total += s(d);
    if (s(d) > 0) unspent.insert(d);
  }
  std::vector<double> w(num_datasets);
  for (int32_t d = 0; d < num_datasets; ++d) w[d] = s(d) / static_cast<double>(total);
  int64_t k = 0;
  while (!unspent.empty()) {
    const double k_double = std::max(static_cast<double>(k), 1.0);
    int32_t best = -1;
    double best_error = std::numeric_limits<double>::lowest();
    for (int32_t d : unspent) {
      const double error = w[d] * k_double - static_cast<double>(taken[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    index(k) = static_cast<int16_t>(best);
    sample_index(k) = taken[best];
    taken[best] += 1;
    if (taken[best] == s(best)) unspent.erase(best);
    ++k;
  }
}

// GPT sample index: row i = (position in document_idx, token offset) where sample i starts.
template <typename T>
py::array_t<T> build_sample_idx(const py::array_t<int32_t> &sizes_, const py::array_t<int32_t> &document_idx_,
                                const int32_t seq_length, const int32_t num_epochs, const int64_t tokens_per_epoch,
                                const bool drop_last_partial_sequence = true,
                                const int add_extra_token_to_sequence = 1) {
  auto sizes = sizes_.unchecked<1>();
  auto document_idx = document_idx_.unchecked<1>();
  const int64_t num_docs = document_idx_.shape(0);
  const int64_t total = static_cast<int64_t>(num_epochs) * tokens_per_epoch - add_extra_token_to_sequence;
  int64_t num_samples;
  if (drop_last_partial_sequence) {
    num_samples = total / seq_length;
  } else {
    // float, as in Megatron, so that rounding (and hence the sample count) is identical
    num_samples = static_cast<int64_t>(std::ceil(static_cast<float>(total) / seq_length));
  }
  py::array_t<T> result({num_samples + 1, static_cast<int64_t>(2)});
  auto out = result.template mutable_unchecked<2>();
  int64_t doc_pos = 0;
  int64_t doc_offset = 0;
  out(0, 0) = 0;
  out(0, 1) = 0;
  for (int64_t i = 1; i <= num_samples; ++i) {
    int64_t remaining = seq_length + add_extra_token_to_sequence;
    while (remaining != 0) {
      const int64_t doc_length = sizes(document_idx(doc_pos)) - doc_offset;
      remaining -= doc_length;
      if (remaining <= 0) {
        // the sample ends inside this document; the next one re-reads the extra token
        doc_offset += remaining + doc_length - add_extra_token_to_sequence;
        remaining = 0;
      } else if (doc_pos == num_docs - 1) {
        // only reachable for the kept partial last sample
        doc_offset = sizes(document_idx(doc_pos)) - add_extra_token_to_sequence;
        break;
      } else {
        ++doc_pos;
        doc_offset = 0;
      }
    }
    out(i, 0) = static_cast<T>(doc_pos);
    out(i, 1) = static_cast<T>(doc_offset);
  }
  return result;
}

// BERT/T5 target length: max_length, or with probability 1/short_seq_ratio a length in [2, max_length].
inline int32_t get_target_sample_len(const int32_t short_seq_ratio, const int32_t max_length,
                                     std::mt19937 &rand32_gen) {
  if (short_seq_ratio == 0) return max_length;
  const auto random_number = rand32_gen();
  if ((random_number % short_seq_ratio) == 0) return 2 + random_number % (max_length - 1);
  return max_length;
}

const int32_t LONG_SENTENCE_LEN = 512;

// BERT/T5 sample map: rows (first sentence, one past last sentence, target length), shuffled.
template <typename DocIdx>
py::array build_mapping_impl(const py::array_t<int64_t> &docs_, const py::array_t<int32_t> &sizes_,
                             const int32_t num_epochs, const uint64_t max_num_samples, const int32_t max_seq_length,
                             const double short_seq_prob, const int32_t seed, const bool verbose,
                             const int32_t min_num_sent) {
  if (num_epochs <= 0 || max_seq_length <= 1 || short_seq_prob < 0.0 || short_seq_prob > 1.0 || seed <= 0)
    throw std::invalid_argument("build_mapping: need num_epochs>0, max_seq_length>1, 0<=short_seq_prob<=1, seed>0");
  auto docs = docs_.unchecked<1>();
  auto sizes = sizes_.unchecked<1>();
  int32_t short_seq_ratio = 0;
  if (short_seq_prob > 0) short_seq_ratio = static_cast<int32_t>(std::round(1.0 / short_seq_prob));

  int64_t num_samples = 0;
  std::vector<DocIdx> maps;
  for (int32_t pass = 0; pass < 2; ++pass) {  // pass 0 counts, pass 1 fills
    const bool fill = pass == 1;
    std::mt19937 rand32_gen(seed);
    uint64_t map_index = 0;
    int64_t empty_docs = 0, one_sent_docs = 0, long_sent_docs = 0;
    for (int32_t epoch = 0; epoch < num_epochs; ++epoch) {
      if (map_index >= max_num_samples) break;
      for (int64_t doc = 0; doc < docs_.shape(0) - 1; ++doc) {
        const int64_t first = docs(doc), last = docs(doc + 1);
        int64_t remain = last - first;
        if (epoch == 0 && remain == 0) ++empty_docs;
        if (epoch == 0 && remain == 1) ++one_sent_docs;
        bool has_long = false;
        if (remain > 1) {
          for (int64_t s = first; s < last; ++s) {
            if (sizes(s) > LONG_SENTENCE_LEN) {
              if (epoch == 0) ++long_sent_docs;
              has_long = true;
              break;
            }
          }
        }
        if (remain < min_num_sent || has_long) continue;
        int64_t prev_start = first;
        int32_t seq_len = 0, num_sent = 0;
        int32_t target = get_target_sample_len(short_seq_ratio, max_seq_length, rand32_gen);
        for (int64_t s = first; s < last; ++s) {
          seq_len += sizes(s);
          ++num_sent;
          --remain;
          if ((seq_len >= target && remain > 1 && num_sent >= min_num_sent) || remain == 0) {
            if (fill) {
              maps[3 * map_index] = static_cast<DocIdx>(prev_start);
              maps[3 * map_index + 1] = static_cast<DocIdx>(s + 1);
              maps[3 * map_index + 2] = static_cast<DocIdx>(target);
            }
            ++map_index;
            prev_start = s + 1;
            target = get_target_sample_len(short_seq_ratio, max_seq_length, rand32_gen);
            seq_len = 0;
            num_sent = 0;
          }
        }
      }
    }
    if (!fill) {
      if (verbose) {
        std::cout << "    number of empty documents: " << empty_docs << std::endl
                  << "    number of documents with one sentence: " << one_sent_docs << std::endl
                  << "    number of documents with long sentences: " << long_sent_docs << std::endl
                  << "    will create mapping for " << map_index << " samples" << std::endl;
      }
      num_samples = static_cast<int64_t>(map_index);
      maps.assign(3 * num_samples, 0);
    }
  }
  std::mt19937_64 rand64_gen(seed + 1);
  for (int64_t i = num_samples - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(rand64_gen() % (i + 1));
    for (int c = 0; c < 3; ++c) std::swap(maps[3 * i + c], maps[3 * j + c]);
  }
  py::array_t<DocIdx> result({num_samples, static_cast<int64_t>(3)});
  std::copy(maps.begin(), maps.end(), result.mutable_data());
  return result;
}

py::array build_mapping(const py::array_t<int64_t> &docs_, const py::array_t<int32_t> &sizes_,
                        const int num_epochs, const uint64_t max_num_samples, const int max_seq_length,
                        const double short_seq_prob, const int seed, const bool verbose, const int32_t min_num_sent) {
  if (sizes_.size() > std::numeric_limits<uint32_t>::max())
    return build_mapping_impl<uint64_t>(docs_, sizes_, num_epochs, max_num_samples, max_seq_length, short_seq_prob,
                                        seed, verbose, min_num_sent);
  return build_mapping_impl<uint32_t>(docs_, sizes_, num_epochs, max_num_samples, max_seq_length, short_seq_prob,
                                      seed, verbose, min_num_sent);
}

PYBIND11_MODULE(helpers_cpp, m) {
  m.def("build_mapping", &build_mapping);
  m.def("build_sample_idx_int32", &build_sample_idx<int32_t>);
  m.def("build_sample_idx_int64", &build_sample_idx<int64_t>);
  m.def("build_blending_indices", &build_blending_indices);
  m.def("build_exhaustive_blending_indices", &build_exhaustive_blending_indices);
}
