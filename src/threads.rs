//! What every threaded part shares: a lock that survives a panicked holder, and the text a
//! panic carried.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, keeping the data when a thread panicked while holding it: that panic is reported
/// on its own path (as a worker's failure), and the data behind the lock (statistics, fault
/// slots, pools) stays valid for the report.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The message of a panic's payload (`panic!` with a literal or a formatted message), or
/// `None` for any other payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> Option<&str> {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_payloads_give_their_text() {
        let literal = std::panic::catch_unwind(|| panic!("stage 2")).unwrap_err();
        let formatted = std::panic::catch_unwind(|| panic!("step {}", 7)).unwrap_err();
        let other = std::panic::catch_unwind(|| std::panic::panic_any(3u8)).unwrap_err();
        assert_eq!(panic_message(&*literal), Some("stage 2"));
        assert_eq!(panic_message(&*formatted), Some("step 7"));
        assert_eq!(panic_message(&*other), None);
    }

    #[test]
    fn a_poisoned_lock_still_gives_its_data() {
        let m = std::sync::Arc::new(Mutex::new(5));
        let held = m.clone();
        let _ = std::thread::spawn(move || {
            let _guard = held.lock().unwrap();
            panic!("holder dies");
        })
        .join();
        assert!(m.is_poisoned());
        assert_eq!(*lock(&m), 5);
    }
}
