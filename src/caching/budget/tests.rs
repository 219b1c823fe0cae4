//! The count and the charge of a pool's budget, and the limit's checks.

use super::*;

#[test]
fn a_refused_or_dropped_charge_gives_its_bytes_back_and_flags_the_thread() {
    let b = PoolBudget::new(7);
    b.set_limit(Some(100));
    b.try_charge(60).unwrap().commit();
    assert!(!take_refusal());
    assert!(b.try_charge(41).is_none(), "60 + 41 passes 100");
    assert!(take_refusal());
    assert!(!take_refusal(), "taken once");
    assert_eq!(b.reserved(), 60);
    let r = std::panic::catch_unwind(|| {
        let _c = b.try_charge(40).unwrap();
        panic!("the driver call panicked");
    });
    assert!(r.is_err());
    assert_eq!(b.reserved(), 60);
    // A charge that passes clears an earlier refusal of the thread.
    assert!(b.try_charge(50).is_none());
    b.try_charge(40).unwrap().settle(30);
    assert!(!take_refusal());
    assert_eq!(b.reserved(), 90);
    b.adjust(-30);
    b.uncharge(60);
    assert_eq!(b.reserved(), 0);
}

#[test]
fn a_limit_of_zero_refuses_everything_and_none_refuses_nothing() {
    let b = PoolBudget::new(0);
    assert_eq!(b.limit(), None);
    b.try_charge(usize::MAX / 4).unwrap().commit();
    b.uncharge(usize::MAX / 4);
    b.set_limit(Some(0));
    assert_eq!(b.limit(), Some(0));
    assert!(b.try_charge(1).is_none());
    assert!(b.try_charge(0).is_some(), "nothing more is not more than 0");
    b.set_limit(None);
    assert!(b.try_charge(1 << 40).is_some());
    assert_eq!(b.reserved(), 0);
}

#[test]
fn limits_from_c_take_every_i64_and_uint64_max_only_above() {
    assert_eq!(limit_from_c(u64::MAX).unwrap(), None);
    assert_eq!(limit_from_c(0).unwrap(), Some(0));
    assert_eq!(limit_from_c(i64::MAX as u64).unwrap(), Some(i64::MAX));
    let e = limit_from_c(-1i64 as u64 - 1).unwrap_err();
    assert!(e.message().contains("over 2^63-1"), "{}", e.message());
}

#[test]
fn the_table_shares_one_budget_per_pool_and_forgets_it() {
    let t = Budgets::default();
    let a = t.get_or_create(3);
    a.set_limit(Some(5));
    assert!(std::sync::Arc::ptr_eq(&a, &t.get_or_create(3)));
    assert_eq!(t.get(3).unwrap().limit(), Some(5));
    assert!(t.get(4).is_none());
    t.forget(3);
    assert!(t.get(3).is_none());
    assert_eq!(t.all().len(), 0);
}

/// Found by the red team of issue 43: a size past `i64::MAX`, cast, was negative and passed
/// any limit (a 20 MiB growth then passed a 10 MiB limit beside it).
#[test]
fn a_charge_past_i64_max_is_refused_and_counts_nothing() {
    let b = PoolBudget::new(3);
    b.set_limit(Some(10 << 20));
    for size in [1usize << 63, usize::MAX] {
        assert!(b.try_charge(size).is_none(), "{size}");
        assert!(take_refusal());
        assert_eq!(b.reserved(), 0);
    }
    b.try_charge(10 << 20).unwrap().commit();
    assert_eq!(b.reserved(), 10 << 20);
}
