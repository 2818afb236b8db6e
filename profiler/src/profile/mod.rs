//! Aggregation of symbolized samples into a [`Profile`]: the shape every
//! writer in [`crate::export`] reads.

mod model;

pub use model::*;
