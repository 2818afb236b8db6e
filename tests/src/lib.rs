//! Helpers for the privileged end-to-end tests.
