-- Back to the planner's default for the store's PL/pgSQL functions.
DO $do$
DECLARE
    v_function regprocedure;
BEGIN
    FOR v_function IN
        SELECT p.oid::regprocedure
          FROM pg_proc p
          JOIN pg_language l ON l.oid = p.prolang
         WHERE l.lanname = 'plpgsql'
           AND p.pronamespace = (SELECT c.relnamespace FROM pg_class c
                                  WHERE c.oid = to_regclass('idempotency_keys'))
           AND p.proname IN ('idempotency_reserve', 'idempotency_replay', 'idempotency_complete',
                             'idempotency_tx_claim', 'idempotency_release',
                             'idempotency_renew_lease', 'idempotency_completed_by')
    LOOP
        EXECUTE format('ALTER FUNCTION %s RESET enable_seqscan RESET jit', v_function);
    END LOOP;
END
$do$;
