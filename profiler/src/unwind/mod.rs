//! Native unwinding without frame pointers: `.eh_frame` to compact tables for
//! the kernel side.
