"""The sublayer boundary: [finalize] -> [all-reduce] -> post-norm -> scaled residual add -> next norm."""
