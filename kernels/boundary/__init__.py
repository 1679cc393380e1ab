"""The sublayer boundary: finalize, all-reduce, post-norm, scaled residual, next norm."""
