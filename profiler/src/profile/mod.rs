//! Aggregation of symbolized samples into a [`Profile`]: the shape every
//! writer in [`crate::export`] reads.

mod aggregate;
pub mod clr_sampling;
mod model;

pub use aggregate::Aggregator;
pub use model::*;
