// The KV-split rule every MLA decode family's plan follows (host code).
#pragma once
#include <algorithm>
#include <cstdint>

#include "hmoe/mla_decode.h"

namespace hmoe {

// KV splits for `ctas` CTAs a split (requests x head groups) when `slots` CTAs fit on the device at
// once and a request has at most `max_tiles` KV tiles: as many splits as one wave of CTAs holds (a
// grid that already fills the slots is not split; a split keeps at least 2 tiles), then the fewest
// splits with the same tiles per CTA: every split costs a partial write and its share of the combine
// pass. (1 x 32768 x 128, portable kernel: 64 splits of 16 tiles ran 54.0 us where 60 splits with 18
// tiles in the longest ran 57.9: docs/perf/mla_decode.md.)
inline int mla_num_splits(int slots, int ctas, int max_tiles) {
  max_tiles = std::max(1, max_tiles);
  const int max_splits = std::max(1, std::min(kMlaMaxSplits, max_tiles / 2));
  const int fit = std::clamp(slots / std::max(1, ctas), 1, max_splits);
  const int per = (max_tiles + fit - 1) / fit;
  return (max_tiles + per - 1) / per;
}

}  // namespace hmoe
