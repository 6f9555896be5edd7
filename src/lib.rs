pub mod sim;
pub mod trace;
