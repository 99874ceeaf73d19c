#include "model/fp8_blocks.hpp"

#include <sstream>
#include <stdexcept>

namespace kiln::model {

torch::Tensor dequantize_fp8_blocks(const torch::Tensor& w, const torch::Tensor& scale_inv, int64_t block_rows,
                                    int64_t block_cols, torch::Dtype out) {
  auto fail = [&](const std::string& why) {
    std::ostringstream s;
    s << "FP8 block dequantisation: " << why << " (weight " << w.sizes() << " " << w.scalar_type() << ", scale_inv "
      << scale_inv.sizes() << " " << scale_inv.scalar_type() << ", block " << block_rows << "x" << block_cols << ")";
    throw std::invalid_argument(s.str());
  };
  if (w.dim() != 2 || w.scalar_type() != torch::kFloat8_e4m3fn) fail("the weight must be 2-D float8_e4m3fn");
  if (block_rows < 1 || block_cols < 1) fail("the block must be at least 1x1");
  if (!scale_inv.is_floating_point() || scale_inv.dim() != 2) fail("scale_inv must be a 2-D float tensor");
  const int64_t R = w.size(0), C = w.size(1);
  const int64_t gr = (R + block_rows - 1) / block_rows, gc = (C + block_cols - 1) / block_cols;
  if (scale_inv.size(0) != gr || scale_inv.size(1) != gc)
    fail("scale_inv must be [" + std::to_string(gr) + ", " + std::to_string(gc) + "] for this weight and block");
  // Each scale repeated over its block, then the edge blocks cropped to the weight.
  auto s = scale_inv.to(torch::kFloat)
               .repeat_interleave(block_rows, 0)
               .repeat_interleave(block_cols, 1)
               .narrow(0, 0, R)
               .narrow(1, 0, C);  // [R, C]
  return (w.to(torch::kFloat) * s).to(out);
}

}  // namespace kiln::model
