"""What the ops share: whether a call may use Triton, dependent launches, counters, module protocols."""
