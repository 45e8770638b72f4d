-- A LISTEN connection's liveness probe (a half-open TCP connection is silent).

-- name: ping
SELECT 1;
