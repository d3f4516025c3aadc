"""GPTQ onto a K-quant (weights/kquants): each 256-column super-block's grid (d, dmin and the
quantized sub-scales and sub-minimums) is fitted when the column loop reaches it, from the
error-updated weights, with the Hessian diagonal as the importance of each column (llama.cpp's
imatrix is the same mean of x², up to a factor). GPTQ then rounds each column onto that fixed
grid and pushes its error onto the columns after it, as for any group.

With act-order the columns of a super-block are no longer visited together, so the grids are
fitted up front from the unpermuted weight (static groups), and act-order only orders the rounding.
"""

import torch

from optkit.weights import kquants
from optkit.weights.kquants import KGrid


class SuperBlockGrids:
    """The grids of one weight's super-blocks, fitted as the column loop comes to them."""

    def __init__(self, qtype: str, importance: torch.Tensor):
        self.qtype = qtype
        self.importance = importance  # [in]: the Hessian diagonal
        self.pieces: dict[int, KGrid] = {}

    def fit(self, w: torch.Tensor, first_column: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Grid of the super-blocks of w ([out, n·256], from `first_column`): (scales, zero points)
        [out, n·subs] on w's device; integer zeros for Q3_K/Q6_K."""
        grid = kquants.fit_grid(w, self.qtype, self.importance[first_column : first_column + w.shape[1]])
        self.pieces[first_column] = grid
        zeros = grid.zeros()
        scales = grid.scales()
        if zeros is None:
            zeros = torch.zeros(scales.shape, dtype=torch.int8)
        return scales.to(w.device), zeros.to(w.device)

    def grid(self) -> KGrid:
        """The whole weight's grid, on the CPU."""
        pieces = [self.pieces[k] for k in sorted(self.pieces)]

        def joined(field: str) -> torch.Tensor | None:
            parts = [getattr(p, field) for p in pieces]
            return None if parts[0] is None else torch.cat([t.cpu() for t in parts], dim=1)

        return KGrid(joined("d"), joined("sc"), joined("dmin"), joined("m"))
