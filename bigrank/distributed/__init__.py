"""Distribution: collectives with autograd, the item-parallel catalog, and all-gather thresholding."""
